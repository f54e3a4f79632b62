"""BERT's parameter names and shapes and its KV cache layout from the config alone, no torch: what the registry's
entry for "bert" declares (memory fit and the HF folder's name check read them before any model is built;
tests/engine/model/test_registry.py holds them equal to the built engine.model.bert model's).

Names are HF transformers' BertModel state_dict keys (modeling_bert.py), its NSP pooler left out (the
architecture's `hf_unused`).
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.core.kv_cache_spec import NO_KV_CACHE, KVCacheSpec


def bert_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter of the BERT encoder of shape `cfg` (engine.model.bert)."""
    h, inner = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (cfg.vocab_size, h),
        "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, h),
        "embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}

    def linear(name: str, n_in: int, n_out: int) -> None:
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}"
        for proj in ("query", "key", "value"):
            linear(f"{p}.attention.self.{proj}", h, cfg.num_heads * cfg.head_dim)
        linear(f"{p}.attention.output.dense", cfg.num_heads * cfg.head_dim, h)
        linear(f"{p}.intermediate.dense", h, inner)
        linear(f"{p}.output.dense", inner, h)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{p}.{norm}.weight"] = shapes[f"{p}.{norm}.bias"] = (h,)
    return shapes


def bert_kv_layout(cfg: ModelConfig) -> tuple[KVCacheSpec, ...]:
    """An encoder keeps no KV cache: kind "none" in every layer (every token attends to its whole row at once)."""
    return (NO_KV_CACHE,) * cfg.num_layers
