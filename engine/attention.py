"""Paged attention: the plain torch reference (CPU, tests, the oracle for the GPU kernels).

KV cache layout, per layer: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
Token t of a request lives in block `block_table[t // block_size]` at offset `t % block_size`; its flat slot is
`block_id * block_size + offset` (the slot mapping). Source: Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention" (SOSP 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where the tokens of one step sit in the batch and in the KV cache. Built once per step by the model runner.

    The step's tokens are flattened: request b owns rows query_start_loc[b]:query_start_loc[b+1] of every [T, ...]
    activation. Its query token j sits at position seq_lens[b] - q_len_b + j and attends to keys 0..that position.

    Attributes:
        slot_mapping: int64 [T], the flat KV slot each new token's K/V is written to.
        query_start_loc: int32 [B + 1], prefix sums of the per-request query lengths (host copy in `query_lens`).
        seq_lens: int32 [B], tokens in the KV cache per request after this step (context + new tokens).
        block_tables: int32 [B, max_blocks], block ids per request, padded with 0.
        query_lens: list of B ints (host), new tokens per request this step.
        seq_lens_host: list of B ints (host), the same as seq_lens.
        decode_only: True when every request has exactly one new token (the fast decode path).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens_host: list[int]
    decode_only: bool

    @classmethod
    def single_prefill(cls, n: int, block_size: int, device: torch.device) -> AttentionMetadata:
        """One request prefilling n tokens from an empty private cache whose blocks 0..ceil(n / block_size) - 1 it
        owns in order (slot i = token i): the metadata of perplexity scoring and calibration forwards."""
        blocks = -(-n // block_size)
        return cls(slot_mapping=torch.arange(n, device=device),
                   query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
                   seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
                   block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
                   query_lens=[n], seq_lens_host=[n], decode_only=False)


def private_kv_cache(n: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (k_cache, v_cache), each [ceil(n / block_size), block_size, num_kv_heads, head_dim] of `dtype`: one
    layer's cache for a single request of n tokens, laid out as `AttentionMetadata.single_prefill` expects."""
    shape = (-(-n // block_size), block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's keys and values in the paged cache.

    k, v: [T, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: int64 [T]. Writes in place.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] keys (or values) of one request, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """Causal attention of the step's queries over each request's cached keys and values (reference path).

    q: [T, num_heads, head_dim]; caches as in the module docstring (already holding this step's K/V);
    returns [T, num_heads, head_dim] in q's dtype. Grouped-query attention: query head h reads KV head
    h // (num_heads // num_kv_heads) (Ainslie et al., "GQA", 2023). Softmax in fp32 when q is half precision.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if meta.decode_only:
        # One query per request: gather every context padded to the longest and mask the padding.
        seq_lens = meta.seq_lens_host
        max_len = max(seq_lens)
        block_size = k_cache.shape[1]
        max_blocks = (max_len + block_size - 1) // block_size
        tables = meta.block_tables[:, :max_blocks].long()
        k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, L, Hkv, D]
        v = v_cache[tables].flatten(1, 2)[:, :max_len]
        positions = torch.arange(max_len, device=q.device)
        mask = positions[None, :] < meta.seq_lens.to(q.device)[:, None]  # [B, L]
        # GQA without copies: the `group` query heads of one KV head are that head's queries, all at the same
        # position, so they share the padding mask: [B, Hkv, group, D] against [B, Hkv, L, D].
        qb = q.reshape(q.shape[0], num_kv_heads, group, q.shape[2])
        kb = k.permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, L, D]
        vb = v.permute(0, 2, 1, 3).to(q.dtype)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None, None, :], scale=scale)
        return o.reshape(q.shape)
    out = torch.empty_like(q)
    start = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_host, strict=True)):
        end = start + q_len
        k = _gather_context(k_cache, meta.block_tables[b], seq_len)  # [L, Hkv, D]
        v = _gather_context(v_cache, meta.block_tables[b], seq_len)
        qb = q[start:end].transpose(0, 1)  # [H, Lq, D]
        kb = k.transpose(0, 1).to(q.dtype)  # [Hkv, L, D]; enable_gqa maps query head h to KV head h // group
        vb = v.transpose(0, 1).to(q.dtype)
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Chunked prefill or decode: query j sits at position seq_len - q_len + j.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
        start = end
    return out
