"""engine.layers.packed_causal_attention against attention computed row by row: causal (SDPA's is_causal), with a
sliding window, soft-capped scores and sinks (the eager form with an explicit mask), grouped-query heads, rows of
mixed lengths in one padded call, and rows all of one length (no mask)."""

from __future__ import annotations

import pytest
import torch

from engine.layers.eager_attention import eager_attention
from engine.layers.packed_causal_attention import PackedCausalMetadata, packed_causal_attention, scratch_kv

HEADS, KV_HEADS, DIM, SCALE = 4, 2, 8, 8 ** -0.5


def _row_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], window: int | None,
                softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    out, start = [], 0
    for n in lens:
        qr, kr, vr = (x[start:start + n].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        i = torch.arange(n)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed &= i[None, :] > i[:, None] - window
        mask = torch.zeros(n, n).masked_fill_(~allowed, float("-inf"))
        out.append(eager_attention(qr, kr, vr, mask, SCALE, softcap=softcap, gqa=True,
                                   sinks=None if sinks is None else sinks.view(HEADS, 1, 1)).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("lens", [[5, 1, 9, 3], [4, 4, 4]])
@pytest.mark.parametrize("window, softcap, sinks", [(None, None, False), (3, None, False), (None, 5.0, False),
                                                     (2, None, True)])
def test_equals_attention_row_by_row(lens: list[int], window: int | None, softcap: float | None,
                                     sinks: bool) -> None:
    torch.manual_seed(0)
    t = sum(lens)
    q, k, v = torch.randn(t, HEADS, DIM), torch.randn(t, KV_HEADS, DIM), torch.randn(t, KV_HEADS, DIM)
    sink = torch.randn(HEADS) if sinks else None
    meta = PackedCausalMetadata.of(lens, torch.device("cpu"))
    k_cache, v_cache = scratch_kv(t, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    k_cache.view(t, KV_HEADS, DIM)[meta.slot_mapping] = k
    v_cache.view(t, KV_HEADS, DIM)[meta.slot_mapping] = v
    ours = packed_causal_attention(q, k_cache, v_cache, meta, SCALE, sliding_window=window, softcap=softcap,
                                   sinks=sink)
    assert ours.shape == (t, HEADS, DIM) and not ours.isnan().any()
    torch.testing.assert_close(ours, _row_by_row(q, k, v, lens, window, softcap, sink), atol=1e-5, rtol=1e-5)
    assert meta.padded == (len(set(lens)) > 1)


def test_bad_batches_and_caches_are_refused() -> None:
    with pytest.raises(ValueError, match="rows of >= 1 tokens"):
        PackedCausalMetadata.of([3, 0], torch.device("cpu"))
    meta = PackedCausalMetadata.of([2, 3], torch.device("cpu"))
    k, v = scratch_kv(4, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="scratch cache of 5 slots"):
        packed_causal_attention(torch.randn(5, HEADS, DIM), k, v, meta, SCALE)
    k, v = scratch_kv(5, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="sliding_window"):
        packed_causal_attention(torch.randn(5, HEADS, DIM), k, v, meta, SCALE, sliding_window=0)
