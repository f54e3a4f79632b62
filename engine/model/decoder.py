"""The generic causal decoder over flattened tokens and a paged KV cache: every family whose differences from Llama
are ModelConfig fields (Llama, Mistral, Qwen2, Qwen3, Phi-3).

Architecture: Touvron et al., "LLaMA" (2023): pre-norm RMSNorm (Zhang & Sennrich, 2019), rotary position embeddings
(Su et al., RoFormer, 2021; the rotate-half form of HF transformers), grouped-query attention (Ainslie et al., 2023),
SwiGLU MLP (Shazeer, 2020). Parameter names follow HF transformers' LlamaForCausalLM without the "model." prefix.
The blocks live in engine.layers: self_attn (attention), mlp, rms_norm, rope.

The families that differ in structure subclass these classes in files of their own, each overriding the step it
changes, never the walk over the layers: engine.model.gemma (sandwich norms, scaled embeddings, soft-capped logits,
local RoPE), engine.model.moe_decoder (a sparse mixture-of-experts MLP), engine.model.gpt_oss (attention sinks on
the MoE decoder). A config setting a field of those (FAMILY_FIELDS) is refused here unless the class builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import AttentionMetadata, paged_attention_ref
from engine.layers.mlp import MLP
from engine.layers.rms_norm import RMSNorm
from engine.layers.rope import RotaryEmbedding
from engine.layers.self_attn import Attention, AttentionFn
from engine.model.base import ModelBase

if TYPE_CHECKING:
    from engine.core.kv_cache_spec import KVCacheSpec

#: ModelConfig fields whose structure only a family file's model builds (engine.model.gemma, moe_decoder, gpt_oss).
FAMILY_FIELDS = ("num_experts", "attention_sinks", "sandwich_norms", "embedding_scale", "final_logit_softcapping",
                 "rope_local_theta")


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals. A family's layer sets `attention_class` or overrides
    `make_mlp` (the MLP block, built once in __init__)."""

    attention_class: ClassVar[type[Attention]] = Attention

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.self_attn = self.attention_class(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.mlp = self.make_mlp(cfg)

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        """The layer's MLP block: the gated MLP (engine.layers.mlp)."""
        return MLP(cfg)

    @property
    def mlp_input_norm(self) -> RMSNorm:
        """The norm whose output the MLP reads (SmoothQuant folds its factors into it)."""
        return self.post_attention_layernorm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, attn_fn: AttentionFn) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta, attn_fn)
        h, x = self.post_attention_layernorm(h, residual=x)  # x + attention, and its norm, in one pass
        return x + self.mlp(h)


class LlamaModel(ModelBase):
    """The causal decoder and its LM head. A family's model sets `layer_class` and `builds` (the FAMILY_FIELDS it
    runs) and overrides the steps it changes: `embed`, `layer_ropes`, `compute_logits`, `_build_rotary`.

    forward: input_ids int64 [T] (or None and inputs_embeds [T, hidden] in the model's dtype), rope_rows int64 [T]
    (each token's row of the RoPE tables: its position, or with LongRoPE's two factor sets `self.rotary.table_rows`
    of its position and prompt length), per-layer caches (as kv_cache_specs lays them out), metadata, and the paged
    attention function (default the torch reference; the runner passes its backend's, so engines sharing one model
    may run different backends) -> hidden states [T, hidden].
    compute_logits: hidden [S, hidden] -> fp32 logits [S, vocab] (or in the model's dtype).
    Raises ValueError for a config that sets a FAMILY_FIELDS field the class does not build (another family's).
    """

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer
    builds: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        foreign = [f for f in FAMILY_FIELDS if getattr(cfg, f) and f not in self.builds]
        if foreign:
            raise ValueError(f"the {cfg.architecture} model ({type(self).__name__}) does not build {foreign}: a "
                             "config setting them is another family's (engine.model.registry.MODELS)")
        self.config = cfg
        # NOTE: on the meta device (the loaders build there, then fill and materialize_rotary) nn.Embedding's normal_
        # init and RoPE's arithmetic run torch's Python meta kernels, whose first call imports torch._dynamo: ~2 CPU-s
        # per process (every Dask worker paid it) for tensors replaced anyway. An empty embedding weight skips the
        # init, and the placeholder RoPE table is one position on the CPU.
        on_meta = torch.empty(0).device.type == "meta"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if on_meta else None)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
        if cfg.lm_head:  # else the trunk of a decoder embedding model (ModelConfig.lm_head)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
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
        """The RoPE tables (`rotary`) for `positions` positions."""
        self.rotary = RotaryEmbedding(self.config, positions)

    def materialize_rotary(self, device: torch.device) -> None:
        """(Re)build the fp32 RoPE tables on `device`: needed after building on the meta device."""
        self._build_rotary(self.max_positions)
        self.rotary = self.rotary.to(device)

    def forward(self, input_ids: torch.Tensor | None, rope_rows: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                attn_fn: AttentionFn = paged_attention_ref, *, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (the LM head is compute_logits) of input_ids int64 [T],
        or of inputs_embeds [T, hidden] when input_ids is None (taken as they are: `embed` is not applied). Raises
        ValueError when both or neither are given."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("forward takes input_ids or inputs_embeds: exactly one of them, not both or neither")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = self.layer_ropes(rope_rows, x.dtype)
        for layer, (cos, sin), (k_cache, v_cache) in zip(self.layers, ropes, kv_caches, strict=True):
            x = layer(x, cos, sin, k_cache, v_cache, meta, attn_fn)
        return self.norm(x)

    def layer_ropes(self, rope_rows: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's RoPE (cos, sin) of rope_rows int64 [T], in `dtype`: the one table for every layer."""
        return [self.rotary(rope_rows, dtype)] * len(self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] of input_ids int64 [T]."""
        return self.embed_tokens(input_ids)

    def fuse_projections(self) -> int:
        """Merge each layer's Q/K/V and gate/up projections into one GEMM each (Attention.fuse, MLP.fuse), in
        place: the serving layout. Loading, GPTQ and `quantize_model` work on the unfused names, so fuse after
        them. Returns the number of merged modules (0 when already fused)."""
        return sum(int(layer.self_attn.fuse()) + int(layer.mlp.fuse()) for layer in self.layers)

    def compute_logits(self, hidden: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
        """Logits [S, vocab] of hidden [S, hidden]: fp32, or in the model's dtype when not full_precision (what the
        sampler takes: greedy rows need no fp32 copy of [S, vocab]). Raises ValueError without an LM head."""
        if not self.config.lm_head:
            raise ValueError(f"this {self.config.architecture} embedding model has no LM head (its folder holds none); "
                             "it embeds")
        logits = self.lm_head(hidden)
        return logits.float() if full_precision else logits
