"""The mixture-of-experts families: the causal decoder (engine.model.decoder) whose every MLP is a sparse
mixture-of-experts block (engine.layers.moe.SparseMoE: a router, the top-k experts' SwiGLU MLPs, Qwen2-MoE's gated
shared expert when ModelConfig.shared_expert_intermediate_size is set).

Families (the router and its order are ModelConfig.router, set by engine.model.architectures): Mixtral (Jiang et
al., "Mixtral of Experts", 2024), Qwen2-MoE (Qwen team, "Qwen1.5-MoE: Matching 7B Model Performance with 1/3
Activated Parameters", 2024; Qwen2 Technical Report, 2024), Qwen3-MoE (Qwen team, "Qwen3 Technical Report", 2025);
gpt-oss adds attention sinks on top (engine.model.gpt_oss). HF transformers' modeling_mixtral / modeling_qwen2_moe /
modeling_qwen3_moe are the references the parity tests hold us to.
"""

from __future__ import annotations

from torch import nn

from engine.config import ModelConfig
from engine.layers.mlp import MLP
from engine.layers.moe import SparseMoE
from engine.model.decoder import DecoderLayer, LlamaModel


class MoEDecoderLayer(DecoderLayer):
    """The decoder layer with a SparseMoE block as its MLP."""

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        """SparseMoE of cfg's experts, with a dense shared expert of cfg.shared_expert_intermediate_size when set."""
        shared = cfg.shared_expert_intermediate_size
        return SparseMoE(cfg, MLP(cfg, shared) if shared else None)


class MoEDecoderModel(LlamaModel):
    """The causal decoder of MoEDecoderLayer layers. Raises ValueError (SparseMoE's) when cfg has no experts."""

    layer_class = MoEDecoderLayer
    builds = frozenset({"num_experts"})
