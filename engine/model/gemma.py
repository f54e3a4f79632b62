"""Gemma 2 and Gemma 3 text: the causal decoder (engine.model.decoder) with Gemma's block and its ends.

Sources: Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size" (2024); Gemma Team, "Gemma 3
Technical Report" (2025); HF transformers' modeling_gemma2 / modeling_gemma3 (the reference the parity tests hold
us to). What differs from Llama's decoder, each step here:

- sandwich norms: the attention output is normalized (post_attention_layernorm) before its residual add, the MLP's
  input by pre_feedforward_layernorm and its output by post_feedforward_layernorm before that add;
- the token embeddings are scaled by sqrt(hidden_size) (ModelConfig.embedding_scale), rounded to the embedding's
  dtype first, as HF transformers does;
- Gemma 2's final logits are soft-capped: c * tanh(logits / c) (ModelConfig.final_logit_softcapping);
- Gemma 3's "sliding_attention" layers take a RoPE table of their own base (ModelConfig.rope_local_theta, no
  scaling).

The rest are options of the shared blocks, set by the config readers (engine.model.family_fields): RMSNorm of
(1 + weight) (norm_weight_offset), GeGLU with tanh GELU (hidden_act), query_pre_attn_scalar, soft-capped attention
scores (Gemma 2), q/k norms (Gemma 3), per-layer sliding/global windows (layer_types).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.config import ModelConfig
from engine.layers.attention import AttentionMetadata
from engine.layers.rms_norm import RMSNorm
from engine.layers.rope import RotaryEmbedding
from engine.layers.self_attn import AttentionFn
from engine.model.decoder import DecoderLayer, LlamaModel


class GemmaDecoderLayer(DecoderLayer):
    """The decoder layer with Gemma's sandwich norms (module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attn_fn: AttentionFn) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, attn_fn)
        h, x = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual=x)
        return x + self.post_feedforward_layernorm(self.mlp(h))

    @property
    def mlp_input_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm


class GemmaModel(LlamaModel):
    """Gemma 2 / Gemma 3 text (module docstring). Raises ValueError when cfg has no embedding_scale or no
    sandwich_norms (engine.model.family_fields sets both for every Gemma config)."""

    layer_class = GemmaDecoderLayer
    builds = frozenset({"sandwich_norms", "embedding_scale", "final_logit_softcapping", "rope_local_theta"})

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if cfg.embedding_scale is None or not cfg.sandwich_norms:
            raise ValueError(f"a Gemma config sets embedding_scale and sandwich_norms; got {cfg.embedding_scale!r} "
                             f"and {cfg.sandwich_norms!r}")
        self.rotary_local: RotaryEmbedding | None = None
        super().__init__(cfg, max_positions)

    def _build_rotary(self, positions: int) -> None:
        """`rotary`, and `rotary_local` of the sliding layers when cfg.rope_local_theta is set (Gemma 3)."""
        super()._build_rotary(positions)
        cfg = self.config
        if cfg.rope_local_theta is not None:
            if self.rotary.long_from is not None:
                raise ValueError("longrope with a local RoPE base (rope_local_base_freq) is not implemented")
            local = replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None, rope_local_theta=None)
            self.rotary_local = RotaryEmbedding(local, positions)

    def materialize_rotary(self, device: torch.device) -> None:
        super().materialize_rotary(device)
        if self.rotary_local is not None:
            self.rotary_local = self.rotary_local.to(device)

    def layer_ropes(self, rope_rows: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The local table on the sliding layers when cfg.rope_local_theta is set, the global one elsewhere."""
        if self.rotary_local is None:
            return super().layer_ropes(rope_rows, dtype)
        rope, local = self.rotary(rope_rows, dtype), self.rotary_local(rope_rows, dtype)
        return [local if self.config.layer_is_local(i) else rope for i in range(len(self.layers))]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] times cfg.embedding_scale, rounded to the embedding's dtype first."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.embedding_scale, dtype=x.dtype, device=x.device)

    def compute_logits(self, hidden: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
        """LlamaModel.compute_logits, then c * tanh(logits / c) with cfg.final_logit_softcapping c (Gemma 2)."""
        logits = super().compute_logits(hidden, full_precision)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
