"""Gemma 2's attention logit soft-capping in the Triton paged attention kernels, against the dense float64 oracle.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 set here at module
import, before anything imports the kernels; see test_triton_attention.py). The cap is low (1.5) and the scale high
(0.5) so that most scores reach it: the capped and uncapped outputs differ by far more than the tolerance.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from attention_steps import dense_attention, make_step, poison_outside_windows  # noqa: E402
from triton_testing import skip_without_a_backend  # noqa: E402

from engine.layers.triton_attention import (  # noqa: E402
    paged_attention_triton,
    paged_decode_attention,
    paged_prefill_attention,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
CAP, SCALE = 1.5, 0.5
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _needs_a_backend() -> None:
    skip_without_a_backend("engine.kernels.triton_attention_kernels", "paged_decode_kernel")


def _oracles(q, kc, vc, meta, window: int | None) -> torch.Tensor:
    """The capped oracle, checked to be far from the uncapped one (else the test could not fail)."""
    want = dense_attention(q, kc, vc, meta, SCALE, window, softcap=CAP)
    assert (want - dense_attention(q, kc, vc, meta, SCALE, window)).abs().max().item() > 0.1
    if window is not None:  # blocks wholly before each window are NaN: a kernel that reads them fails
        poison_outside_windows(kc, vc, meta, window)
    return want


@pytest.mark.parametrize("window, group, block_size, num_splits", [(None, 1, 8, 1), (None, 3, 16, 3),
                                                                   (5, 3, 8, 1), (37, 1, 16, 3)])
def test_decode_softcap(window: int | None, group: int, block_size: int, num_splits: int) -> None:
    q, kc, vc, meta = make_step([1] * 4, [1, 13, 37, 70], 2 * group, 2, block_size, torch.float32, DEVICE)
    want = _oracles(q, kc, vc, meta, window)
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, SCALE, num_splits=num_splits,
                                 block_n=16, sliding_window=window, softcap=CAP)
    assert (out - want).abs().max().item() < ATOL[torch.float32]


@pytest.mark.parametrize("window, group, block_size", [(None, 1, 8), (None, 3, 16), (5, 3, 8), (16, 1, 16)])
def test_prefill_softcap(window: int | None, group: int, block_size: int) -> None:
    # A full prefill, chunked prefills and a decode row in one step; block_m 16 with group 3 cuts requests into
    # several query tiles.
    q, kc, vc, meta = make_step([21, 5, 1, 40], [21, 30, 19, 67], 2 * group, 2, block_size, torch.float32, DEVICE)
    want = _oracles(q, kc, vc, meta, window)
    out = paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, SCALE,
                                  block_m=16, block_n=16, sliding_window=window, softcap=CAP)
    assert (out - want).abs().max().item() < ATOL[torch.float32]


def test_softcap_bf16_default_tiles_and_bad_caps() -> None:
    """Both kernels through the entry point in bf16 at their default tiles; a cap <= 0 is a ValueError."""
    for query_lens, seq_lens in (([1] * 3, [9, 40, 75]), ([1, 70, 7], [100, 70, 90])):
        for window in (None, 21):
            q, kc, vc, meta = make_step(query_lens, seq_lens, 6, 2, 16, torch.bfloat16, DEVICE)
            want = _oracles(q, kc, vc, meta, window)
            out = paged_attention_triton(q, kc, vc, meta, SCALE, sliding_window=window, softcap=CAP)
            assert (out.float() - want.float()).abs().max().item() < ATOL[torch.bfloat16]
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match="softcap"):
            paged_attention_triton(q, kc, vc, meta, SCALE, softcap=bad)


def test_softcap_saturates_without_nan() -> None:
    """Scores in the thousands (tanh's exp2 far past fp32 range in the naive form) cap to +-c, never NaN: against
    the oracle on a step whose q is scaled up 1000x."""
    q, kc, vc, meta = make_step([1, 6], [20, 6], 4, 2, 8, torch.float32, DEVICE)
    q = q * 1000.0
    want = dense_attention(q, kc, vc, meta, SCALE, None, softcap=CAP)
    out = paged_attention_triton(q, kc, vc, meta, SCALE, softcap=CAP)
    assert not out.isnan().any() and (out - want).abs().max().item() < ATOL[torch.float32]
