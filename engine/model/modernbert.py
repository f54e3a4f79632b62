"""ModernBERT encoder (ModernBertEncoderModel) over a packed batch of rows, no KV cache: the hidden states an embedding
model pools.

Architecture: Warner et al., "Smarter, Better, Faster, Longer: A Modern Bidirectional Encoder for Fast, Memory
Efficient, and Long Context Finetuning and Inference" (2024), as HF transformers' modeling_modernbert.py computes it:
token embeddings, LayerNorm (no bias: norm_bias false); per layer pre-LN blocks (layer 0 has no attention norm: its
input is the embedding norm's output) of bidirectional attention over one fused Wqkv, RoPE on q and k, Wo, added to
the input, then a GeGLU MLP (Wi -> input, gate halves -> Wo(gelu(input) * gate), exact GELU), added; a final
LayerNorm. No linear has a bias (attention_bias / mlp_bias false: refused otherwise, engine.model.architectures).

Layers alternate global and local attention (ModelConfig.layer_types: every global_attn_every_n_layers-th layer
global, layer 0 first): a local layer attends a symmetric window of its row, |i - j| <= ModelConfig.sliding_window
(HF's sliding_window = local_attention // 2; engine.layers.encoder_attention.EncoderMetadata.windowed), and rotates
q and k with its own RoPE base (ModelConfig.rope_local_theta, HF's local_rope_theta; global layers rope_theta, HF's
global_rope_theta). Positions count from 0 in each row (HF's position_ids of a right-padded batch). Parameter names
are ModernBertModel's state_dict keys (engine.model.modernbert_names); dropout is training only.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.encoder_attention import EncoderMetadata, encoder_attention
from engine.layers.rope import RotaryEmbedding, apply_rope
from engine.model.base import ModelBase
from engine.model.bert_names import bert_kv_layout

#: ModelConfig fields of other families' structure, which this model does not build: a config setting them is refused.
NOT_BUILT = ("num_experts", "attention_sinks", "sandwich_norms", "embedding_scale", "final_logit_softcapping",
             "attn_logit_softcapping", "query_pre_attn_scalar", "qkv_bias", "o_bias", "qk_norm", "rope_scaling",
             "rotary_dim", "type_vocab_size", "position_padding_idx", "norm_weight_offset")


def _layer_norm(cfg: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=False)


class _Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, on_meta: bool) -> None:
        super().__init__()
        # NOTE: on the meta device an empty weight skips nn.Embedding's init (engine.model.decoder says why)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size) if on_meta else None)
        self.norm = _layer_norm(cfg)


class _Attention(nn.Module):
    """ModernBertAttention's projections: Wqkv (q, k, v stacked in that order) and Wo, no biases."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.num_heads * cfg.head_dim
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * width, bias=False)
        self.Wo = nn.Linear(width, cfg.hidden_size, bias=False)


class _GeGLU(nn.Module):
    """ModernBertMLP: Wi [2 * intermediate, hidden] -> (input, gate) halves -> Wo(gelu(input) * gate), exact GELU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], model dtype."""
        hidden, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(F.gelu(hidden) * gate)


class ModernBertLayer(nn.Module):
    """One pre-LN encoder block (HF ModernBertEncoderLayer): x + attn(attn_norm(x)), then + mlp(mlp_norm(x)); layer 0
    without attn_norm (HF's nn.Identity, no parameters). `local`: a sliding-window layer (its window and RoPE)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.local = cfg.layer_window(layer) is not None
        self.attn_norm: nn.Module = _layer_norm(cfg) if layer else nn.Identity()
        self.attn = _Attention(cfg)
        self.mlp_norm = _layer_norm(cfg)
        self.mlp = _GeGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        """x [T, hidden] (model dtype), cos / sin [T, head_dim] (model dtype) of the layer's RoPE at each token's
        position, meta the batch's EncoderMetadata (windowed for a local layer) -> [T, hidden]."""
        t = x.shape[0]
        qkv = self.attn.Wqkv(self.attn_norm(x)).view(t, 3, self.num_heads, self.head_dim)
        # q and k rotate together, in fp32 as HF's apply_rotary_pos_emb (its cos / sin rounded to the model's dtype)
        qk = apply_rope(qkv[:, :2].flatten(1, 2).float(), cos, sin).to(x.dtype)
        qkv = torch.cat((qk.view(t, 2, self.num_heads, self.head_dim), qkv[:, 2:]), dim=1)
        x = x + self.attn.Wo(encoder_attention(qkv, meta))
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEncoderModel(ModelBase):
    """The ModernBERT encoder (module docstring): `forward` gives the last hidden states [T, hidden] of a packed
    batch, after final_norm; no LM head (compute_logits raises), no KV cache (kv_cache_specs of kind "none").

    Args:
        cfg: its shape (engine.model.family_fields.modernbert_fields reads it from config.json).
        max_positions: not used: the RoPE tables cover every position a row may hold (cfg.max_row_tokens), whatever
            the engine's max_model_len (the embedder cuts rows at that limit, not at max_model_len).

    Raises:
        ValueError: for a config of other families' structure (NOT_BUILT, naming the fields) or an activation other
            than the exact GELU.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        foreign = [f for f in NOT_BUILT if getattr(cfg, f)]
        if foreign:
            raise ValueError(f"the {cfg.architecture} model (ModernBertEncoderModel) does not build {foreign}: a "
                             "config setting them is another family's (engine.model.registry.MODELS)")
        if cfg.hidden_act != "gelu":
            raise ValueError(f"ModernBERT runs the exact GELU (hidden_activation gelu), got {cfg.hidden_act!r}")
        self.config = cfg
        self.max_positions = cfg.max_row_tokens
        on_meta = torch.empty(0).device.type == "meta"
        self.embeddings = _Embeddings(cfg, on_meta)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _layer_norm(cfg)
        self.kv_cache_specs = bert_kv_layout(cfg)
        if on_meta:  # a one-position placeholder on the CPU (engine.model.decoder says why); materialize_rotary
            with torch.device("cpu"):
                self._build_rotary(1)
        else:
            self._build_rotary(self.max_positions)

    def _build_rotary(self, positions: int) -> None:
        """`rotary` (the global layers' RoPE, rope_theta) and `rotary_local` (the local layers', rope_local_theta;
        rope_theta when None), fp32 tables of `positions` positions."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg, positions)
        self.rotary_local = RotaryEmbedding(replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta),
                                            positions)

    def materialize_rotary(self, device: torch.device) -> None:
        """(Re)build the RoPE tables on `device`: needed after building on the meta device."""
        self._build_rotary(self.max_positions)
        self.rotary, self.rotary_local = self.rotary.to(device), self.rotary_local.to(device)

    @property
    def embed_tokens(self) -> nn.Module:  # type: ignore[override]
        """The token embedding (ModelBase's name for it)."""
        return self.embeddings.tok_embeddings

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] of int64 input_ids [T] (HF's inputs_embeds: `forward` applies the embedding
        norm to either)."""
        return self.embeddings.tok_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, rope_rows: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                meta: EncoderMetadata | None = None, attn_fn: object = None, *,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states [T, hidden] (model dtype, after final_norm) of a packed batch: int64 input_ids [T] (or
        inputs_embeds [T, hidden]), rope_rows int64 [T] each token's index within its row (0, 1, ... per row, below
        cfg.max_row_tokens: its RoPE position), meta the rows' EncoderMetadata. kv_caches and attn_fn are not used
        (no cache). Raises ValueError unless exactly one of input_ids / inputs_embeds is given, or without meta."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("ModernBertEncoderModel.forward takes input_ids or inputs_embeds, exactly one of them")
        if meta is None:
            raise ValueError("ModernBertEncoderModel.forward needs the batch's EncoderMetadata "
                             "(engine.layers.encoder_attention)")
        x = self.embeddings.norm(self.embed(input_ids) if inputs_embeds is None else inputs_embeds)
        ropes = {False: self.rotary(rope_rows, x.dtype)}
        metas = {False: meta}
        if any(layer.local for layer in self.layers):  # one band mask and one local table per forward
            ropes[True] = self.rotary_local(rope_rows, x.dtype)
            metas[True] = meta.windowed(int(self.config.sliding_window or 0))
        for layer in self.layers:
            x = layer(x, *ropes[layer.local], metas[layer.local])
        return self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
        """Raises NotImplementedError: ModernBERT (ModernBertEncoderModel) has no LM head here (its masked-LM head is
        not held)."""
        raise NotImplementedError("modernbert is an encoder without an LM head: it embeds (LLMEngine.embed), it "
                                  "does not generate")

    def tie_weights(self) -> None:
        """Nothing to tie: no LM head."""
