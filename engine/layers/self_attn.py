"""The self-attention block over the paged KV cache: Q/K/V projections (fused or not), per-head q/k norms, RoPE,
the KV write and the paged attention function the runner passes (engine.layers.attention's contract)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from engine.config import ModelConfig
from engine.core.kv_cache_spec import full_attention
from engine.layers.attention import AttentionMetadata, write_kv
from engine.layers.linear import fuse_linears
from engine.layers.rms_norm import RMSNorm, fused_ops
from engine.layers.rope import apply_rope


class AttentionFn(Protocol):
    """A paged attention function (engine.layers.attention.paged_attention_ref's contract): (q, k_cache, v_cache, meta,
    scale, *, sliding_window, softcap, sinks) -> [T, num_heads, head_dim]. softcap and sinks are passed only when a
    model sets them."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, *, sliding_window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor: ...


class Attention(nn.Module):
    """Self-attention over the paged KV cache.

    Q, K and V come from q_proj/k_proj/v_proj (the names of the model files and of GPTQ), or, after `fuse()`, from
    one qkv_proj: one GEMM of N = (num_heads + 2 * num_kv_heads) * head_dim instead of three narrower ones.
    With cfg.qkv_bias the three carry a bias (Qwen2); with cfg.qk_norm queries and keys go through a per-head
    RMSNorm (q_norm / k_norm, weight [head_dim]) before RoPE (Qwen3, Gemma 3). `layer` is the layer's index (its
    window: cfg.layer_window); scores scale by cfg.query_pre_attn_scalar ** -0.5 when set, else head_dim ** -0.5.
    With cfg.o_bias o_proj has a bias (gpt-oss). A subclass passes more keywords to the attention function through
    `_attn_kwargs` (gpt-oss's sinks: engine.model.gpt_oss.SinkAttention).
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # what this layer keeps in the KV pool (engine.model.kv_layout.layer_kv_spec says the same from the config)
        self.kv_cache_spec = full_attention(cfg.num_kv_heads, cfg.head_dim, cfg.layer_window(layer))
        self.sliding_window = self.kv_cache_spec.window  # None: full causal attention
        # passed to the attention function only when set, so functions without soft-capping serve other models
        self.attn_kwargs = {"softcap": cfg.attn_logit_softcapping} if cfg.attn_logit_softcapping else {}
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        offset = cfg.norm_weight_offset
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.qkv_proj: nn.Module | None = None

    def fuse(self) -> bool:
        """Replace q_proj/k_proj/v_proj by one qkv_proj (engine.layers.linear.fuse_linears). Returns whether it fused
        (False when already fused or when the three cannot be merged)."""
        return fuse_linears(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, attn_fn: AttentionFn) -> torch.Tensor:
        """Everything before o_proj: x [T, hidden] -> [T, num_heads * head_dim]; writes this step's K/V into the
        caches. (GPTQ calibration needs o_proj's input.)"""
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            ops = fused_ops(qkv)
            if (ops is not None and self.q_norm is None and qkv.dim() == 2
                    and cos.dtype == qkv.dtype == k_cache.dtype):
                q = ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, h)  # one pass (C++ or Triton)
                return attn_fn(q, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window,
                               **self._attn_kwargs()).reshape(t, h * d)
            qk = qkv[:, :(h + hkv) * d].view(t, h + hkv, d)
            if self.q_norm is not None:
                qk = torch.cat((self._head_norm(self.q_norm, qk[:, :h]), self._head_norm(self.k_norm, qk[:, h:])), 1)
            qk = apply_rope(qk, cos, sin)  # one RoPE for Q and K
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, (h + hkv) * d:].view(t, hkv, d)
        else:
            q, k = self.q_proj(x).view(t, h, d), self.k_proj(x).view(t, hkv, d)
            if self.q_norm is not None:
                q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = self.v_proj(x).view(t, hkv, d)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return attn_fn(q, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window,
                       **self._attn_kwargs()).reshape(t, self.num_heads * self.head_dim)

    def _attn_kwargs(self) -> dict[str, object]:
        """The attention function's optional keywords this layer sets (softcap); {} for Llama's."""
        return self.attn_kwargs

    @staticmethod
    def _head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of x [T, heads, head_dim] (as rows [T * heads, head_dim]); same shape back."""
        t, n, d = x.shape
        return norm(x.reshape(t * n, d)).view(t, n, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attn_fn: AttentionFn) -> torch.Tensor:
        return self.o_proj(self.attend(x, cos, sin, k_cache, v_cache, meta, attn_fn))
