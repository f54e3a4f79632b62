"""Llama-family decoder over flattened tokens and a paged KV cache.

Architecture: Touvron et al., "LLaMA" (2023): pre-norm RMSNorm (Zhang & Sennrich, 2019), rotary position embeddings
(Su et al., RoFormer, 2021; the rotate-half form of HF transformers), grouped-query attention (Ainslie et al., 2023),
SwiGLU MLP (Shazeer, 2020), or a sparse mixture-of-experts block of them (engine.layers.moe) where
ModelConfig.num_experts > 0. Parameter names follow HF transformers' LlamaForCausalLM without the "model." prefix.
The blocks live in engine.layers: self_attn (attention), mlp, moe, rms_norm, rope.

The variants of other families are ModelConfig fields: Gemma 2/3 (Gemma Team, "Gemma 2", 2024; "Gemma 3", 2025):
sandwich norms of (1 + weight), GeGLU with tanh GELU, the embedding scale, query_pre_attn_scalar, soft-capped
attention and final logits, per-layer sliding/global attention, a local RoPE base for the sliding layers. gpt-oss
(OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025): attention sinks, an o_proj bias, MoE biases and clamped SwiGLU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import AttentionMetadata, paged_attention_ref
from engine.layers.mlp import MLP
from engine.layers.moe import SparseMoE
from engine.layers.rms_norm import RMSNorm
from engine.layers.rope import RotaryEmbedding
from engine.layers.self_attn import Attention, AttentionFn
from engine.model.base import ModelBase

if TYPE_CHECKING:
    from engine.core.kv_cache_spec import KVCacheSpec


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals; the MLP is a SparseMoE block when cfg.num_experts > 0.
    With cfg.sandwich_norms (Gemma) the attention output is normalized (post_attention_layernorm) before its
    residual add, the MLP's input by pre_feedforward_layernorm and its output by post_feedforward_layernorm before
    that residual add."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.mlp: MLP | SparseMoE
        if cfg.num_experts:
            shared = cfg.shared_expert_intermediate_size
            self.mlp = SparseMoE(cfg, MLP(cfg, shared) if shared else None)
        else:
            self.mlp = MLP(cfg)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset) if cfg.sandwich_norms else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attn_fn: AttentionFn) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, attn_fn)
        if self.pre_feedforward_layernorm is not None:
            h, x = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual=x)
            return x + self.post_feedforward_layernorm(self.mlp(h))
        h, x = self.post_attention_layernorm(h, residual=x)  # x + attention, and its norm, in one pass
        return x + self.mlp(h)


class LlamaModel(ModelBase):
    """The causal decoder and its LM head: every family whose differences are ModelConfig fields.

    forward: input_ids int64 [T] (or None and inputs_embeds [T, hidden] in the model's dtype), rope_rows int64 [T]
    (each token's row of the RoPE tables: its position, or with LongRoPE's two factor sets `self.rotary.table_rows`
    of its position and prompt length), per-layer caches (as kv_cache_specs lays them out), metadata, and the paged
    attention function (default the torch reference; the runner passes its backend's, so engines sharing one model
    may run different backends) -> hidden states [T, hidden].
    compute_logits: hidden [S, hidden] -> fp32 logits [S, vocab] (or in the model's dtype).
    """

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        # NOTE: on the meta device (the loaders build there, then fill and materialize_rotary) nn.Embedding's normal_
        # init and RoPE's arithmetic run torch's Python meta kernels, whose first call imports torch._dynamo: ~2 CPU-s
        # per process (every Dask worker paid it) for tensors replaced anyway. An empty embedding weight skips the
        # init, and the placeholder RoPE table is one position on the CPU.
        on_meta = torch.empty(0).device.type == "meta"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if on_meta else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.rotary_local: RotaryEmbedding | None = None
        if on_meta:
            with torch.device("cpu"):
                self._build_rotary(1)
        else:
            self._build_rotary(max_positions)

    @property
    def kv_cache_specs(self) -> tuple[KVCacheSpec, ...]:
        """The KV cache layout, one KVCacheSpec per decoder layer, read from the layers themselves (so a model whose
        `layers` are cut or replaced lays out exactly the caches its forward walks)."""
        return tuple(layer.self_attn.kv_cache_spec for layer in self.layers)

    def _build_rotary(self, positions: int) -> None:
        """The RoPE tables: `rotary`, and `rotary_local` of the sliding layers when cfg.rope_local_theta is set."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg, positions)
        if cfg.rope_local_theta is not None:
            if self.rotary.long_from is not None:
                raise ValueError("longrope with a local RoPE base (rope_local_base_freq) is not implemented")
            local = replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None, rope_local_theta=None)
            self.rotary_local = RotaryEmbedding(local, positions)

    def materialize_rotary(self, device: torch.device) -> None:
        """(Re)build the fp32 RoPE tables on `device`: needed after building on the meta device."""
        self._build_rotary(self.max_positions)
        self.rotary = self.rotary.to(device)
        if self.rotary_local is not None:
            self.rotary_local = self.rotary_local.to(device)

    def forward(self, input_ids: torch.Tensor | None, rope_rows: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                attn_fn: AttentionFn = paged_attention_ref, *, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (the LM head is compute_logits) of input_ids int64 [T],
        or of inputs_embeds [T, hidden] when input_ids is None (taken as they are: no embedding scale). Raises
        ValueError when both or neither are given."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("forward takes input_ids or inputs_embeds: exactly one of them, not both or neither")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary(rope_rows, x.dtype)
        local = self.rotary_local(rope_rows, x.dtype) if self.rotary_local is not None else rope
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos, sin = local if self.config.layer_is_local(i) else rope
            x = layer(x, cos, sin, k_cache, v_cache, meta, attn_fn)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] of input_ids int64 [T], times cfg.embedding_scale when set (rounded to the
        embedding's dtype first, as HF transformers' Gemma does)."""
        x = self.embed_tokens(input_ids)
        scale = self.config.embedding_scale
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype, device=x.device)

    def fuse_projections(self) -> int:
        """Merge each layer's Q/K/V and gate/up projections into one GEMM each (Attention.fuse, MLP.fuse), in
        place: the serving layout. Loading, GPTQ and `quantize_model` work on the unfused names, so fuse after
        them. Returns the number of merged modules (0 when already fused)."""
        return sum(int(layer.self_attn.fuse()) + int(layer.mlp.fuse()) for layer in self.layers)

    def compute_logits(self, hidden: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
        """Logits [S, vocab] of hidden [S, hidden]: fp32, or in the model's dtype when not full_precision (what the
        sampler takes: greedy rows need no fp32 copy of [S, vocab]). With cfg.final_logit_softcapping c the logits
        are c * tanh(logits / c) (Gemma 2)."""
        logits = self.lm_head(hidden)
        logits = logits.float() if full_precision else logits
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
