"""Causal attention over a packed batch of whole rows with no KV cache: each token of a row attends to itself and
the tokens before it in its own row, none of another row's. What a causal decoder computes when it only pools
(a decoder embedding model's last token, a *ForSequenceClassification's score): one forward of many rows, nothing
kept for a next step.

The decoder's layers are the generation path's, unchanged (engine.layers.self_attn.Attention writes each step's
keys and values through `meta.slot_mapping`, then calls the attention function it is given): `PackedCausalMetadata`
maps token t to slot t of a scratch "cache" of exactly T slots (`scratch_kv`, one pair shared by every layer, since
each layer writes all T slots before it reads them), and `packed_causal_attention` reads the keys and values back
from it in token order. The rows are then padded into [B, heads, L_max, head_dim] for one
torch scaled_dot_product_attention call per layer, as engine.layers.encoder_attention does for encoders (its
docstring says why padded and not block-diagonal or one call per row), with a causal mask that also hides the
padded keys; a padded query row sees at least its row's first key (no empty softmax, no NaN) and is dropped after.
Same math as HF transformers' causal decoders on a right-padded batch (softmax(q k^T * scale + causal mask) v;
grouped-query attention as Ainslie et al., "GQA", 2023), plus the sliding window, soft-capping and sinks of
engine.layers.attention's contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.layers.attention import check_sliding_window, check_softcap
from engine.layers.eager_attention import check_sinks, eager_attention
from engine.layers.encoder_attention import pad_scatter


@dataclass(frozen=True)
class PackedCausalMetadata:
    """Where the rows of one packed causal batch sit (the `meta` a decoder's forward passes to its layers).

    Attributes:
        seq_lens: tokens of each row (host), B ints >= 1.
        max_len: the longest row, L_max.
        slot_mapping: int64 [T] on the device, arange(T): token t's slot in the scratch cache (`scratch_kv`).
        scatter: int64 [T] on the device: token t's slot in the padded [B * L_max] layout (row b's j-th token at
            b * L_max + j).
        padded: whether any row is shorter than L_max (False: `scatter` is arange(T) and no key is padding).
    """

    seq_lens: tuple[int, ...]
    max_len: int
    slot_mapping: torch.Tensor
    scatter: torch.Tensor
    padded: bool

    @classmethod
    def of(cls, seq_lens: Sequence[int], device: torch.device) -> PackedCausalMetadata:
        """The metadata of rows of `seq_lens` tokens (each >= 1), packed in that order. Raises ValueError for an
        empty batch or an empty row."""
        lens, scatter = pad_scatter(seq_lens)
        max_len = int(lens.max())
        return cls(tuple(int(n) for n in seq_lens), max_len, torch.arange(scatter.numel(), device=device),
                   scatter.to(device), int(lens.min()) != max_len)

    @property
    def num_tokens(self) -> int:
        """T, the batch's tokens."""
        return int(self.slot_mapping.numel())

    def mask(self, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
        """bool [B, 1, L_max, L_max], True where query j of a row may see key i: i <= j, i a real token of the row
        (or i = 0 for a padded query j), and with a sliding window W, i > j - W. None when plain causal attention
        over unpadded rows needs no mask (SDPA's is_causal)."""
        if not self.padded and sliding_window is None:
            return None
        j = torch.arange(self.max_len, device=device)
        visible = (j[None, :] <= j[:, None])[None]  # [1, Lq, Lk]
        if sliding_window is not None:
            visible = visible & (j[None, :] > j[:, None] - sliding_window)[None]
        if self.padded:
            lens = torch.tensor(self.seq_lens, device=device)
            visible = visible & (j[None, None, :] < lens[:, None, None])
            visible = visible | ((j[None, :, None] >= lens[:, None, None]) & (j == 0)[None, None, :])
        return visible.expand(len(self.seq_lens), -1, -1)[:, None]


def scratch_kv(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) scratch, each [num_tokens, 1, num_kv_heads, head_dim] of `dtype` (uninitialized: every slot is
    written before it is read): the "cache" the layers write one step's keys and values into, slot t = token t."""
    shape = (num_tokens, 1, num_kv_heads, head_dim)
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


def _padded(x: torch.Tensor, meta: PackedCausalMetadata) -> torch.Tensor:
    """[T, heads, D] -> [B, heads, L_max, D], zeros at the padding."""
    b, length = len(meta.seq_lens), meta.max_len
    if meta.padded:
        out = x.new_zeros(b * length, x.shape[1], x.shape[2])
        out[meta.scatter] = x
        x = out
    return x.view(b, length, x.shape[1], x.shape[2]).transpose(1, 2)


def packed_causal_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: PackedCausalMetadata, scale: float, *, sliding_window: int | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each row of a packed batch (module docstring): engine.layers.self_attn.AttentionFn's
    contract with `meta` a PackedCausalMetadata and the caches the `scratch_kv` pair holding this step's keys and
    values at slots 0..T-1.

    q: [T, num_heads, head_dim]; k_cache, v_cache: [T, 1, num_kv_heads, head_dim] (num_heads a multiple of
    num_kv_heads: query head h reads KV head h // (num_heads // num_kv_heads)). Returns [T, num_heads, head_dim] in
    q's dtype. sliding_window: W >= 1 keys per query, its own included; softcap: c > 0 caps the scaled scores to
    c * tanh(s / c); sinks: [num_heads] logits in each head's softmax denominator (engine.layers.eager_attention).
    Raises ValueError on an invalid window, cap or sinks, or caches that do not hold the batch's T tokens."""
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    check_sinks(sinks, q.shape[1])
    t, heads, dim = q.shape
    if k_cache.shape[0] * k_cache.shape[1] != t or v_cache.shape != k_cache.shape:
        raise ValueError(f"packed causal attention reads the step's {t} keys from a scratch cache of {t} slots; got "
                         f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} (engine.layers."
                         "packed_causal_attention.scratch_kv)")
    hkv = k_cache.shape[2]
    k = _padded(k_cache.view(t, hkv, dim).to(q.dtype), meta)
    v = _padded(v_cache.view(t, hkv, dim).to(q.dtype), meta)
    mask = meta.mask(sliding_window, q.device)
    qp = _padded(q, meta)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=hkv != heads)
    else:
        allowed = mask if mask is not None else meta.mask(1 << 30, q.device)  # a window of every key: causal
        additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        out = eager_attention(qp, k, v, additive, scale, softcap=softcap, gqa=True,
                              sinks=None if sinks is None else sinks.view(1, heads, 1, 1))
    out = out.transpose(1, 2).reshape(-1, heads, dim)
    return out[meta.scatter] if meta.padded else out
