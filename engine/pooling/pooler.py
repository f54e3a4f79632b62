"""Pooling a packed batch's last hidden states into one vector per row, in float32.

Source: sentence-transformers' Pooling.forward (sentence_transformer/modules/pooling.py), Dense and Normalize (L2,
torch.nn.functional.normalize): the same modes over the same tokens (special tokens included, as it counts them
with the attention mask), computed on the packed rows (rows b's tokens cu_seqlens[b]:cu_seqlens[b + 1]) by
segment sums / maxima (torch.segment_reduce over the rows' lengths: the rows' tokens in order, as index_add_ sums
them, without its serial scatter) instead of a padded [B, L, H] tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.pooling.st_config import PoolingConfig


def pool(hidden: torch.Tensor, seq_lens: list[int], config: PoolingConfig,
         dense: Sequence[Callable[[torch.Tensor], torch.Tensor]] = ()) -> torch.Tensor:
    """Embeddings float32 [B, config.dimension(hidden)] of hidden [T, hidden] (any float dtype) holding B rows of
    `seq_lens` tokens (sum = T) back to back: per mode, in order, "cls" the row's first token, "lasttoken" its
    last, "mean" the mean of its tokens, "mean_sqrt_len_tokens" their sum / sqrt(length), "max" the elementwise
    maximum; then each `dense` module in turn (engine.pooling.dense.Dense: config.dense loaded); L2-normalized
    when config.normalize."""
    x = hidden.float()
    device = x.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    out: list[torch.Tensor] = []
    sums: torch.Tensor | None = None
    for mode in config.modes:
        if mode == "cls":
            out.append(x[starts])
        elif mode == "lasttoken":
            out.append(x[ends - 1])
        elif mode == "max":
            out.append(torch.segment_reduce(x, "max", lengths=lens))
        else:  # mean, mean_sqrt_len_tokens
            if sums is None:
                sums = torch.segment_reduce(x, "sum", lengths=lens)
            n = lens.to(x.dtype)[:, None]
            out.append(sums / (n if mode == "mean" else n.sqrt()))
    pooled = torch.cat(out, dim=-1)
    for module in dense:
        pooled = module(pooled)
    return F.normalize(pooled, p=2, dim=-1) if config.normalize else pooled
