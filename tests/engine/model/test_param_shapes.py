"""engine.model.tensor_names.param_shapes: the parameters the causal decoder holds, from the config alone (no torch:
the CLI's fit check reads a model's weight bytes through it, jobs.plan.model_fit), equal to the model's own
state_dict for every option that adds or reshapes a parameter."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model.registry import build_model, model_param_names
from engine.model.tensor_names import LM_HEAD, is_linear_weight, param_shapes

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, max_position_embeddings=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)


@pytest.mark.parametrize("options", [
    {}, {"tie_word_embeddings": True}, {"qkv_bias": True, "o_bias": True}, {"qk_norm": True},
    {"architecture": "gemma2", "sandwich_norms": True, "embedding_scale": 2.0},
    {"architecture": "gpt_oss", **MOE, "attention_sinks": True}, {"architecture": "qwen3_moe", **MOE},
    {"architecture": "gpt_oss", **MOE, "attention_sinks": True, "expert_bias": True},
    {"architecture": "qwen2_moe", **MOE, "shared_expert_intermediate_size": 40},
], ids=["llama", "tied", "biases", "qk_norm", "sandwich", "sinks", "moe", "moe_bias", "shared_expert"])
def test_param_shapes_are_the_models_state_dict(options: dict) -> None:
    cfg = ModelConfig(**SHAPE, **options)
    with torch.device("meta"):
        model = build_model(cfg, 1)
    held = {name: tuple(p.shape) for name, p in model.state_dict().items()
            if not (cfg.tie_word_embeddings and name == f"{LM_HEAD}.weight")}
    shapes = param_shapes(cfg)
    assert shapes == held and sorted(shapes) == sorted(model_param_names(cfg))
    # the linear weights the INT4/INT8 paths take: every projection and the LM head, never a stacked expert weight
    linear = {n for n in shapes if is_linear_weight(n)}
    assert len(linear) == cfg.num_layers * (4 + (3 if not cfg.num_experts else
                                                 3 * bool(cfg.shared_expert_intermediate_size))) \
        + (not cfg.tie_word_embeddings)
