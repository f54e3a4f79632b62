"""Random attention steps over a paged KV cache, shared by the attention kernel tests (Triton, CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.layers.attention import AttentionMetadata, write_kv

HEAD_DIM = 64


def make_step(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, block_size: int,
              dtype: torch.dtype, device: str = "cpu", head_dim: int = HEAD_DIM, seed: int = 0,
              extra_table_cols: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random step: q [T, H, D], caches with each request's blocks at shuffled (non-contiguous) ids, and its
    metadata. Context K/V are random cache contents; this step's K/V go in through `write_kv` and the slot mapping,
    as in the model. extra_table_cols pads the block tables (as CUDA-graph capture does)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks no request owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for n in blocks_per_req:
        tables.append(perm[:n])
        perm = perm[n:]
    width = max(blocks_per_req) + extra_table_cols
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, q_len, s in zip(tables, query_lens, seq_lens, strict=True) for p in range(s - q_len, s)]
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v_new = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    write_kv(k_new, v_new, k_cache, v_cache, slot_mapping)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        query_lens=list(query_lens),
        seq_lens_host=list(seq_lens),
        decode_only=all(n == 1 for n in query_lens),
    )
    return q.to(device), k_cache.to(device), v_cache.to(device), meta


def dense_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None,
                    mask: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The oracle of every paged attention path: request by request, its keys and values read out of the paged
    cache into one dense [seq_len, Hkv, D] tensor, scores in float64, and an explicit boolean mask: the query at
    position i sees key j when j <= i and (no window, or i - W < j, HF transformers' `sliding_window_overlay`), or
    where `mask(request index, query positions [Q, 1], key positions [1, K])` is true when given (in place of
    both); with `softcap` c the scores are c * tanh(score / c) first (Gemma 2). Returns [T, H, D] in q's dtype."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_host, strict=True)):
        pos = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[3])[slots].double().repeat_interleave(group, dim=1)
        v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[3])[slots].double().repeat_interleave(group, dim=1)
        qb = q[start:start + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [H, q_len, seq_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        visible = pos[None, :] <= i
        if sliding_window is not None:
            visible &= pos[None, :] > i - sliding_window
        if mask is not None:
            visible = mask(b, i, pos[None, :])
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += q_len
    return out


def poison_outside_windows(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           sliding_window: int) -> int:
    """Fill with NaN, in place, every KV block that lies wholly before the window of its request's first query of
    the step (no query of the step may see any of its keys): a kernel that reads such a block, even to mask it,
    returns NaN. Returns how many blocks were poisoned."""
    block_size = k_cache.shape[1]
    poisoned = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_host, strict=True)):
        first_visible = max(0, seq_len - q_len - sliding_window + 1)
        for i in range(first_visible // block_size):
            block = meta.block_tables[b, i].item()
            k_cache[block] = float("nan")
            v_cache[block] = float("nan")
            poisoned += 1
    return poisoned
