"""One sequence through the model from its own private KV cache: no scheduler, no block pool, no batching.

What perplexity scoring, next-token oracles, GPTQ and SmoothQuant calibration, and the INT4 tuning all run: token
ids int64 [n] from position 0, a zeroed cache of `BLOCK_SIZE`-token blocks that the sequence owns in order (slot i =
token i, engine.layers.attention.AttentionMetadata.single_prefill), the whole sequence prefilled in one call.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.layers.attention import AttentionMetadata, private_kv_cache
from engine.model.base import ModelBase

#: KV cache block size (tokens) of private-cache forwards.
BLOCK_SIZE = 16


def private_prefill(cfg: ModelConfig, n: int, kv_dtype: torch.dtype,
                    device: torch.device) -> tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor]]:
    """(metadata, (k_cache, v_cache)) for prefilling one sequence of n tokens: the caches are one layer's, zeroed,
    [ceil(n / BLOCK_SIZE), BLOCK_SIZE, num_kv_heads, head_dim] of `kv_dtype` on `device`. For callers that run the
    decoder layers themselves (GPTQ's staged forward); one pair may serve every layer in turn outside autograd,
    since each layer writes all n slots before it reads them."""
    return (AttentionMetadata.single_prefill(n, BLOCK_SIZE, device),
            private_kv_cache(n, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, kv_dtype, device))


def forward_sequence(model: ModelBase, token_ids: torch.Tensor, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Final hidden states [n, hidden] (after the last RMSNorm; model.compute_logits gives the logits) of one
    sequence token_ids: int64 [n], n >= 1, on the model's device, prefilled from position 0 through a fresh private
    KV cache per layer (so autograd may run through it: no cache is written twice). LongRoPE takes one factor set
    for the whole sequence, by its length, as HF transformers' forward of it does.

    kv_dtype: dtype of the cache; None = the dtype of the model's first parameter. Runs in whatever grad mode the
    caller set. Raises ValueError for an empty or non-1-D token_ids."""
    if token_ids.ndim != 1 or token_ids.shape[0] == 0:
        raise ValueError(f"token_ids must be int64 [n] with n >= 1, got shape {tuple(token_ids.shape)}")
    n, device = token_ids.shape[0], token_ids.device
    kv_dtype = kv_dtype or next(model.parameters()).dtype
    meta = AttentionMetadata.single_prefill(n, BLOCK_SIZE, device)
    none = torch.empty(0, dtype=kv_dtype, device=device)
    caches = [private_kv_cache(n, BLOCK_SIZE, spec.num_kv_heads, spec.head_size, kv_dtype, device)
              if spec.has_cache else (none, none) for spec in model.kv_cache_specs]
    return model(token_ids, model.rotary.table_rows(torch.arange(n, device=device), n), caches, meta)
