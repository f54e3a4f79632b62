"""Bidirectional (encoder) attention over a packed batch of rows: every token of a row attends to every token of
its own row, none of another's, and no KV cache is kept.

The rows arrive flattened ([T, ...], row b owning tokens cu_seqlens[b]:cu_seqlens[b + 1]), so the projections, the
LayerNorms and the MLP (nearly all of an encoder's FLOPs at embedding lengths) never compute on padding.

fp32 on a CPU without AVX-512, head_dim 32 (or 64 on rows under 256 tokens), no sliding window: our C++ kernel
(engine/kernels/csrc/encoder_kernels.cpp) attends each (row, head) straight from the packed QKV, no padding at all:
torch's CPU SDPA runs these small heads at a fraction of the GEMMs' rate (all-MiniLM's 12 heads of 32 on an AVX2
EPYC: the kernel took 1.6-3.4x less time per layer at 19-192 tokens a row, the same at 256 without padding;
bench/README.md "Embeddings on an AVX2-only CPU"). Elsewhere (bf16, AVX-512 CPUs, where it is not measured, GPUs,
other head sizes, windows) attention alone is padded, into [B, heads, L_max, head_dim], and run by one torch
scaled_dot_product_attention call per layer with a key-padding mask (no mask when every row has the same length).
Why this and not the alternatives:

- one packed sequence with a block-diagonal mask computes the full [T, T] score matrix, B times the work of the
  rows' own blocks (T = 2048 tokens of 64-token rows: 32x), and torch's CPU SDPA has no varlen (cu_seqlens) kernel
  that would skip the empty blocks;
- one SDPA call per row is exact but costs a call (and its thread-pool dispatch) per row per layer: hundreds per
  step for short texts, more than the attention itself on CPU.

The rows of a batch are sorted by length (engine.pooling.embedder), so the padding attention computes is small.
Padded query rows attend to their row's real keys (never to nothing: no NaN) and are dropped after. Same math as
HF transformers' BertSelfAttention (softmax(q k^T / sqrt(head_dim)) v, Vaswani et al. 2017), whose padded batch
masks the same keys.

A local (sliding-window) layer (ModernBERT's: Warner et al., "Smarter, Better, Faster, Longer", 2024) attends
within a symmetric band of its row, |i - j| <= half; `EncoderMetadata.windowed` gives the batch's metadata for it
(one [B, 1, L_max, L_max] mask per forward, shared by every local layer). The band is masked, not skipped: the
scores are those of full attention.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.kernels.cpu_kernels import encoder_fp32_ops

# The head sizes encoder_kernels.cpp's encoder_attention is built for -> the longest row from which torch's SDPA is at
# least as fast on the AVX2 EPYC (None: never; `python -m bench.encoder_kernels`, bench/README.md): at head_dim 64,
# 256-token rows took 8.9 ms against SDPA's 7.3 (unpadded), 512 the same.
KERNEL_HEAD_DIMS: dict[int, int | None] = {32: None, 64: 256}


def pad_scatter(seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(lens int64 [B], scatter int64 [T]) on the host of a packed batch of rows of `seq_lens` tokens: token t's
    slot in the padded [B * L_max] layout (row b's j-th token at b * L_max + j). Raises ValueError for an empty
    batch or an empty row."""
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"a packed batch needs >= 1 rows of >= 1 tokens, got lengths {list(seq_lens)[:8]}")
    lens = torch.tensor(list(seq_lens), dtype=torch.int64)
    starts = torch.arange(len(lens), dtype=torch.int64) * int(lens.max())
    offsets = torch.arange(int(lens.sum()), dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(lens, 0) - lens, lens)
    return lens, torch.repeat_interleave(starts, lens) + offsets


@dataclass(frozen=True)
class EncoderMetadata:
    """Where the rows of one packed encoder batch sit.

    Attributes:
        seq_lens: tokens of each row (host), B ints >= 1.
        max_len: the longest row, L_max.
        scatter: int64 [T] on the device: token t's slot in the padded [B * L_max] layout (row b's j-th token at
            b * L_max + j).
        key_mask: bool [B, 1, 1, L_max] on the device, True where a key is a real token; None when every row has
            L_max tokens (no padding).
        attn_mask: bool [B or 1, 1, L_max, L_max] on the device, True where query i may attend key j: a sliding
            window's band, padding included (`windowed`); None: key_mask alone.
    """

    seq_lens: tuple[int, ...]
    max_len: int
    scatter: torch.Tensor
    key_mask: torch.Tensor | None
    attn_mask: torch.Tensor | None = None
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, seq_lens: Sequence[int], device: torch.device) -> EncoderMetadata:
        """The metadata of rows of `seq_lens` tokens (each >= 1), packed in that order. Raises ValueError for an
        empty batch or an empty row."""
        lens, scatter = pad_scatter(seq_lens)
        max_len = int(lens.max())
        mask = None
        if int(lens.min()) != max_len:
            mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :].to(device)
        return cls(tuple(int(n) for n in seq_lens), max_len, scatter.to(device), mask)

    def windowed(self, half: int) -> EncoderMetadata:
        """This batch's metadata for attention within a symmetric window: query i attends the keys j of its row with
        |i - j| <= half (HF transformers' sliding_window_bidirectional_overlay, ModernBERT's local layers; half =
        its local_attention // 2). A padded query attends its row's real keys (never nothing: no NaN), as in
        `encoder_attention`. Returns self when no row is longer than half + 1 (the band holds every key). Raises
        ValueError for half < 0."""
        if half < 0:
            raise ValueError(f"a sliding window's half width must be >= 0 tokens, got {half}")
        if self.max_len <= half + 1:
            return self
        device = self.scatter.device
        pos = torch.arange(self.max_len, device=device)
        band = ((pos[:, None] - pos[None, :]).abs() <= half)[None, None]  # [1, 1, L, L]
        if self.key_mask is not None:  # real keys only; a padded query (False in the key mask) any real key
            band = self.key_mask & (band | ~self.key_mask.transpose(-1, -2))
        return replace(self, attn_mask=band, _bias={})

    def mask_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """attn_mask (else key_mask) as the additive mask SDPA adds to the scores: 0 where a query may attend a key,
        -inf where not, of `dtype` [B or 1, 1, 1 or L_max, L_max]; None without a mask. Built once per dtype and kept:
        every layer of a forward reuses it (torch's CPU SDPA turns a bool mask into this same float mask on each
        call, which at 64 tokens a row cost a fifth of the attention: bench/README.md "Embeddings on an AVX2-only
        CPU")."""
        mask = self.key_mask if self.attn_mask is None else self.attn_mask
        if mask is None:
            return None
        if dtype not in self._bias:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self._bias[dtype] = bias.masked_fill_(~mask, float("-inf"))
        return self._bias[dtype]

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """int64 [B + 1] on the host: row b owns tokens cu_seqlens[b]:cu_seqlens[b + 1] (the C++ kernel's input)."""
        return torch.tensor((0, *self.seq_lens), dtype=torch.int64).cumsum(0)

    @property
    def num_tokens(self) -> int:
        """T, the batch's tokens."""
        return int(self.scatter.numel())


def packed_kernel(qkv: torch.Tensor, meta: EncoderMetadata) -> ModuleType | None:
    """The C++ kernels when their `encoder_attention` serves this call (module docstring: fp32 on a CPU without
    AVX-512, autograd off, a build for AVX2 + FMA: engine.kernels.cpu_kernels.encoder_fp32_ops; head_dim in
    KERNEL_HEAD_DIMS and rows shorter than its limit there, no window), else None."""
    dim = qkv.shape[-1]
    if meta.attn_mask is not None or dim not in KERNEL_HEAD_DIMS:
        return None
    limit = KERNEL_HEAD_DIMS[dim]
    return encoder_fp32_ops(qkv) if limit is None or meta.max_len < limit else None


def encoder_attention(qkv: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v within each row of a packed batch (within meta.attn_mask's band when set).

    qkv: q, k and v stacked, [T, 3, heads, head_dim] in the model's dtype (padded once for all three). Returns
    [T, heads * head_dim], same dtype."""
    t, _, heads, dim = qkv.shape
    ops = packed_kernel(qkv, meta)
    if ops is not None:
        return ops.encoder_attention(qkv.contiguous(), meta.cu_seqlens, dim ** -0.5)
    b, length = len(meta.seq_lens), meta.max_len
    if meta.key_mask is None:
        padded = qkv.view(b, length, 3, heads, dim)
    else:
        padded = qkv.new_zeros(b * length, 3, heads, dim)
        padded[meta.scatter] = qkv
        padded = padded.view(b, length, 3, heads, dim)
    q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask_bias(qkv.dtype))
    out = out.transpose(1, 2).reshape(b * length, heads * dim)
    return out if meta.key_mask is None else out[meta.scatter]
