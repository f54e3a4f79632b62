"""BERT encoder (BertEncoderModel) over a packed batch of rows, no KV cache: the hidden states an embedding model pools.

Architecture: Devlin et al., "BERT" (2019), as HF transformers' modeling_bert.py computes it: the sum of word,
absolute position and token type embeddings, LayerNorm; per layer bidirectional multi-head attention
(engine.layers.encoder_attention), its output projection added to the input and LayerNorm'd (post-LN), then an MLP
of exact (erf) GELU, added and LayerNorm'd. Dropout is training only. Parameter names are BertEncoderModel's state_dict
keys (engine.model.bert_names), so an HF folder's tensors fill it by name; the NSP pooler is not held (sentence
embeddings pool the last hidden states: engine.pooling).

A single text is one segment, token type 0 everywhere (what sentence-transformers feeds it); a cross-encoder's pair
passes its token types (1 on the second text: HF's token_type_ids) to `forward`.

XLM-RoBERTa (multilingual-e5, bge-m3) is this model with other config values (engine.model.family_fields
.xlm_roberta_fields): its LayerNorm epsilon, one token type, and positions that start past its padding_idx
(ModelConfig.position_padding_idx; HF's create_position_ids_from_input_ids), computed in `positions`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.encoder_attention import EncoderMetadata, encoder_attention
from engine.layers.linear import fuse_linears, linear_add_layer_norm, linear_gelu
from engine.model.base import ModelBase
from engine.model.bert_names import bert_kv_layout


class _Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.rms_norm_eps)


class _SelfAttention(nn.Module):
    """BertSelfAttention's projections: query, key, value (HF's names, filled from the checkpoint), merged into one
    `qkv` GEMM by `fuse` (the serving layout: one GEMM, one bias add and one padding per layer)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.num_heads * cfg.head_dim
        self.query = nn.Linear(cfg.hidden_size, width)
        self.key = nn.Linear(cfg.hidden_size, width)
        self.value = nn.Linear(cfg.hidden_size, width)
        self.qkv: nn.Module | None = None

    def fuse(self) -> bool:
        """Merge query, key and value into `qkv` (engine.layers.linear.fuse_linears), in place; False when already
        fused or when they cannot merge."""
        return fuse_linears(self, ("query", "key", "value"), "qkv")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> q, k, v stacked [T, 3, heads * head_dim] (model dtype)."""
        if self.qkv is not None:
            return self.qkv(x).unflatten(-1, (3, -1))
        return torch.stack([self.query(x), self.key(x), self.value(x)], dim=1)


class _DenseNorm(nn.Module):
    """dense then LayerNorm(dense(x) + residual): BertSelfOutput and BertOutput."""

    def __init__(self, n_in: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(n_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return linear_add_layer_norm(self.dense, self.LayerNorm, x, residual)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _DenseNorm(cfg.num_heads * cfg.head_dim, cfg)


class _Intermediate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)


class BertLayer(nn.Module):
    """One post-LN encoder block (HF BertLayer)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _DenseNorm(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], both in the model's dtype."""
        qkv = self.attention.self(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        ctx = encoder_attention(qkv, meta)
        h = self.attention.output(ctx, x)
        return self.output(linear_gelu(self.intermediate.dense, h), h)


class _Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))


class BertEncoderModel(ModelBase):
    """The BERT encoder: `forward` gives the last hidden states [T, hidden] of a packed batch; no LM head
    (compute_logits raises), no KV cache (kv_cache_specs of kind "none")."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.max_positions = min(max_positions or cfg.max_row_tokens, cfg.max_row_tokens)
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.kv_cache_specs = bert_kv_layout(cfg)

    @property
    def layers(self) -> nn.ModuleList:  # type: ignore[override]
        """The encoder's blocks (ModelBase's name for them)."""
        return self.encoder.layer

    @property
    def embed_tokens(self) -> nn.Module:  # type: ignore[override]
        """The word embedding (ModelBase's name for it)."""
        return self.embeddings.word_embeddings

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Word embeddings [T, hidden] of int64 input_ids [T] (HF's inputs_embeds: positions and token types are
        added in `forward`)."""
        return self.embeddings.word_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, rope_rows: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                meta: EncoderMetadata | None = None, attn_fn: object = None, *,
                inputs_embeds: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states [T, hidden] (model dtype) of a packed batch: int64 input_ids [T] (or inputs_embeds
        [T, hidden]), rope_rows int64 [T] each token's index within its row (0, 1, ... per row, below
        cfg.max_row_tokens; the position embedding's rows: `positions`), meta the rows' EncoderMetadata,
        token_type_ids int64 [T] each token's segment (below cfg.type_vocab_size; None: 0 everywhere). kv_caches
        and attn_fn are not used (no cache). Raises ValueError unless exactly one of input_ids / inputs_embeds is
        given, or without meta."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("BertEncoderModel.forward takes input_ids or inputs_embeds, exactly one of them")
        if meta is None:
            raise ValueError("BertEncoderModel.forward needs the batch's EncoderMetadata "
                             "(engine.layers.encoder_attention)")
        emb = self.embeddings
        words = emb.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        types = (emb.token_type_embeddings.weight[0] if token_type_ids is None
                 else emb.token_type_embeddings(token_type_ids))
        x = emb.LayerNorm(words + emb.position_embeddings(self.positions(input_ids, rope_rows)) + types)
        for layer in self.encoder.layer:
            x = layer(x, meta)
        return x

    def positions(self, input_ids: torch.Tensor | None, rope_rows: torch.Tensor) -> torch.Tensor:
        """Rows of the position embedding, int64 [T], for tokens at rope_rows int64 [T] (0, 1, ... within each row)
        of int64 input_ids [T] (None: inputs_embeds were given). BERT: rope_rows. With a padding_idx p
        (XLM-RoBERTa): p + the token's count of non-pad tokens in its row so far, p itself for a pad token; p + 1 +
        rope_rows without input_ids (HF's XLMRobertaEmbeddings: create_position_ids_from_input_ids and
        _from_inputs_embeds)."""
        pad = self.config.position_padding_idx
        if pad is None:
            return rope_rows
        if input_ids is None:
            return rope_rows + pad + 1
        real = (input_ids != pad).to(torch.int64)
        seen = torch.cumsum(real, 0)  # over the packed batch; less what the row's earlier rows hold:
        start = torch.arange(len(rope_rows), device=rope_rows.device) - rope_rows  # each token's row start
        return (seen - (seen - real)[start]) * real + pad

    def fuse_projections(self) -> int:
        """Merge each layer's query, key and value into one GEMM (_SelfAttention.fuse), in place: the serving layout
        (LLMEngine fuses after loading, by HF names). Returns the number of merged modules (0 when already fused)."""
        return sum(int(layer.attention.self.fuse()) for layer in self.encoder.layer)

    def compute_logits(self, hidden: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
        """Raises NotImplementedError: BERT (BertEncoderModel) has no LM head."""
        raise NotImplementedError("bert is an encoder without an LM head: it embeds (LLMEngine.embed), it does not "
                                  "generate")

    def tie_weights(self) -> None:
        """Nothing to tie: no LM head."""
