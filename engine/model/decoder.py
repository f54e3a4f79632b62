"""Llama-family decoder over flattened tokens and a paged KV cache.

Architecture: Touvron et al., "LLaMA" (2023): pre-norm RMSNorm (Zhang & Sennrich, 2019), rotary position embeddings
(Su et al., RoFormer, 2021; the rotate-half form of HF transformers), grouped-query attention (Ainslie et al., 2023),
SwiGLU MLP (Shazeer, 2020), or a sparse mixture-of-experts block of them (engine.layers.moe) where
ModelConfig.num_experts > 0. Parameter names follow HF transformers' LlamaForCausalLM without the "model." prefix.
The norm and RoPE live in engine.layers.rms_norm and engine.layers.rope.

The variants of other families are ModelConfig fields: Gemma 2/3 (Gemma Team, "Gemma 2", 2024; "Gemma 3", 2025):
sandwich norms of (1 + weight), GeGLU with tanh GELU, the embedding scale, query_pre_attn_scalar, soft-capped
attention and final logits, per-layer sliding/global attention, a local RoPE base for the sliding layers. gpt-oss
(OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025): attention sinks, an o_proj bias, MoE biases and clamped SwiGLU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.kernels.gguf_blocks import GGUFBlocks, gguf_blocks_of, set_gguf_blocks
from engine.layers.attention import AttentionMetadata, paged_attention_ref, write_kv
from engine.layers.moe import SparseMoE
from engine.layers.rms_norm import RMSNorm, fused_ops
from engine.layers.rope import RotaryEmbedding, apply_rope
from engine.model.base import ModelBase
from engine.model.kv_layout import layer_kv_spec


class AttentionFn(Protocol):
    """A paged attention function (engine.layers.attention.paged_attention_ref's contract): (q, k_cache, v_cache, meta,
    scale, *, sliding_window, softcap, sinks) -> [T, num_heads, head_dim]. softcap and sinks are passed only when a
    model sets them."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, *, sliding_window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor: ...


def concat_linears(modules: list[nn.Module]) -> nn.Module | None:
    """One module whose output is the concatenation of `modules`' outputs (along out_features), or None when they
    cannot be merged. All take the same input [..., K]; the merged one returns [..., sum(N_i)].

    Plain nn.Linear layers merge by concatenating their weights and biases (all with a bias or all without; as
    vLLM's QKVParallelLinear and MergedColumnParallelLinear hold Q/K/V and gate/up in one matrix; their GGUF
    blocks too, when every part has them: engine.kernels.gguf_blocks.set_gguf_blocks); other module
    types merge through a `concat(modules)` classmethod of their own (e.g. engine.quant.int4_linear.Int4Linear,
    engine.quant.state.AddBias). The originals are not changed.
    """
    first = modules[0]
    if any(type(m) is not type(first) for m in modules):
        return None
    if type(first) is nn.Linear:
        biased = first.bias is not None
        if any((m.bias is not None) != biased or m.weight.dtype != first.weight.dtype
               or m.weight.device != first.weight.device or m.in_features != first.in_features for m in modules):
            return None
        weight = torch.cat([m.weight.detach() for m in modules])
        with torch.device("meta"):
            merged = nn.Linear(first.in_features, weight.shape[0], bias=biased)
        merged.weight = nn.Parameter(weight, requires_grad=False)
        if biased:
            merged.bias = nn.Parameter(torch.cat([m.bias.detach() for m in modules]), requires_grad=False)
        blocks = [gguf_blocks_of(m) for m in modules]
        if all(b is not None for b in blocks):  # the GGUF blocks of the parts, concatenated alike
            joined = GGUFBlocks.concat(blocks)
            if joined is not None:
                set_gguf_blocks(merged, joined)
        return merged
    concat = getattr(type(first), "concat", None)
    return concat(modules) if concat is not None else None


class Attention(nn.Module):
    """Self-attention over the paged KV cache.

    Q, K and V come from q_proj/k_proj/v_proj (the names of the model files and of GPTQ), or, after `fuse()`, from
    one qkv_proj: one GEMM of N = (num_heads + 2 * num_kv_heads) * head_dim instead of three narrower ones.
    With cfg.qkv_bias the three carry a bias (Qwen2); with cfg.qk_norm queries and keys go through a per-head
    RMSNorm (q_norm / k_norm, weight [head_dim]) before RoPE (Qwen3, Gemma 3). `layer` is the layer's index (its
    window: cfg.layer_window); scores scale by cfg.query_pre_attn_scalar ** -0.5 when set, else head_dim ** -0.5.
    With cfg.attention_sinks each head has a sink logit (`sinks` [num_heads]), with cfg.o_bias o_proj a bias (gpt-oss).
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.kv_cache_spec = layer_kv_spec(cfg, layer)  # what this layer keeps in the KV pool
        self.sliding_window = self.kv_cache_spec.window  # None: full causal attention
        # passed to the attention function only when set, so functions without soft-capping serve other models
        self.attn_kwargs = {"softcap": cfg.attn_logit_softcapping} if cfg.attn_logit_softcapping else {}
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None
        offset = cfg.norm_weight_offset
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.qkv_proj: nn.Module | None = None

    def fuse(self) -> bool:
        """Replace q_proj/k_proj/v_proj by one qkv_proj (engine.model.decoder.concat_linears). Returns whether it fused
        (False when already fused or when the three cannot be merged)."""
        if self.qkv_proj is not None:
            return False
        merged = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        if merged is None:
            return False
        self.qkv_proj = merged
        del self.q_proj, self.k_proj, self.v_proj
        return True

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
        """The attention function's optional keywords this layer sets (softcap, sinks); {} for Llama's."""
        return self.attn_kwargs if self.sinks is None else {**self.attn_kwargs, "sinks": self.sinks}

    @staticmethod
    def _head_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of x [T, heads, head_dim] (as rows [T * heads, head_dim]); same shape back."""
        t, n, d = x.shape
        return norm(x.reshape(t * n, d)).view(t, n, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attn_fn: AttentionFn) -> torch.Tensor:
        return self.o_proj(self.attend(x, cos, sin, k_cache, v_cache, meta, attn_fn))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), or GeGLU with cfg.hidden_act "gelu_pytorch_tanh" (gelu, tanh form);
    after `fuse()`, gate and up are one gate_up_proj GEMM. Its width is `intermediate_size` (default
    cfg.intermediate_size; a MoE's shared expert has its own)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = width = intermediate_size or cfg.intermediate_size
        self.silu = cfg.hidden_act == "silu"
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None

    def fuse(self) -> bool:
        """Replace gate_proj/up_proj by one gate_up_proj. Returns whether it fused (as Attention.fuse)."""
        if self.gate_up_proj is not None:
            return False
        merged = concat_linears([self.gate_proj, self.up_proj])
        if merged is None:
            return False
        self.gate_up_proj = merged
        del self.gate_proj, self.up_proj
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            ops = fused_ops(gate_up) if self.silu else None
            if ops is not None and gate_up.dim() == 2:
                return self.down_proj(ops.silu_and_mul(gate_up))
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(self._act(gate) * up)
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) if self.silu else F.gelu(gate, approximate="tanh")


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
        self.kv_cache_specs = tuple(layer.self_attn.kv_cache_spec for layer in self.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.rotary_local: RotaryEmbedding | None = None
        if on_meta:
            with torch.device("cpu"):
                self._build_rotary(1)
        else:
            self._build_rotary(max_positions)

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
