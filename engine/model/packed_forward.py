"""Whole rows through a causal decoder in one forward, with no KV cache kept: the hidden states a pooling task
reads (a decoder embedding model's last token, a decoder sequence classifier's score).

The rows are packed back to back (no padding for the projections and the MLP), each from position 0, and the
decoder's own forward runs them with engine.layers.packed_causal_attention as its attention function: causal
within each row, a scratch cache of exactly the batch's tokens shared by every layer instead of a paged KV cache.
Compared with one private-cache forward per row (engine.model.sequence_forward), a batch of B rows is one GEMM per
projection instead of B.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.layers.packed_causal_attention import PackedCausalMetadata, packed_causal_attention, scratch_kv
from engine.model.base import ModelBase


def forward_packed(model: ModelBase, rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Final hidden states [T, hidden] (model dtype, after the last norm; T = the rows' tokens, row after row) of
    token-id rows, each attending causally to its own tokens only, from position 0 (LongRoPE: each row takes the
    factor set of its own length, as HF transformers' forward of it alone does).

    model: a causal decoder (engine.model.decoder, or a family file built on it) on `device`. Runs in the
    caller's grad mode. Raises ValueError for no rows, an empty row, or a model with no attention layer to run
    (an encoder: it takes engine.layers.encoder_attention's metadata instead)."""
    lens = [len(r) for r in rows]
    meta = PackedCausalMetadata.of(lens, device)
    specs = model.kv_cache_specs
    if not any(spec.has_cache for spec in specs):
        raise ValueError(f"{type(model).__name__} keeps no KV cache: it is no causal decoder; run it with "
                         "engine.layers.encoder_attention.EncoderMetadata")
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.int64, device=device)
    lengths = torch.repeat_interleave(torch.tensor(lens, dtype=torch.int64), torch.tensor(lens))
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    rope_rows = model.rotary.table_rows(positions, lengths).to(device)
    dtype = model.embed(ids[:1]).dtype  # the activations' dtype (an INT4 embedding's too): the fused KV write's
    scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    none = torch.empty(0, dtype=dtype, device=device)
    caches = []
    for spec in specs:  # one scratch pair per KV shape, shared by the layers of that shape
        key = (spec.num_kv_heads, spec.head_size)
        if spec.has_cache and key not in scratch:
            scratch[key] = scratch_kv(meta.num_tokens, spec.num_kv_heads, spec.head_size, dtype, device)
        caches.append(scratch[key] if spec.has_cache else (none, none))
    return model(ids, rope_rows, caches, meta, packed_causal_attention)  # type: ignore[arg-type]
