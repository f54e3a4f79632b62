"""gpt-oss (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025; HF transformers' modeling_gpt_oss, the reference
the parity tests hold us to): the mixture-of-experts decoder (engine.model.moe_decoder) whose attention has a
learned sink logit per head.

The sink joins each head's softmax as one more logit with no value: softmax over [scores, sink], the sink's share
dropped (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2023, learned per head here). The
rest are options of the shared blocks, set by the config readers (engine.model.family_fields): q/k/v and o_proj
biases (qkv_bias, o_bias), alternating sliding/full layers (layer_types), YaRN, top-k-then-softmax routing over
biased logits and biased experts with a clamped SwiGLU (router, expert_bias, swiglu_limit: engine.layers.moe).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.self_attn import Attention
from engine.model.moe_decoder import MoEDecoderLayer, MoEDecoderModel


class SinkAttention(Attention):
    """Attention with a sink logit per head: `sinks` fp [num_heads] (HF name self_attn.sinks), passed to the
    attention function (its `sinks` keyword: engine.layers.attention.paged_attention_ref and the CPU kernel)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    def _attn_kwargs(self) -> dict[str, object]:
        return {**self.attn_kwargs, "sinks": self.sinks}


class GptOssDecoderLayer(MoEDecoderLayer):
    """The MoE decoder layer with SinkAttention."""

    attention_class = SinkAttention


class GptOssDecoder(MoEDecoderModel):
    """gpt-oss 20b / 120b (module docstring)."""

    layer_class = GptOssDecoderLayer
    builds = frozenset({"num_experts", "attention_sinks"})
