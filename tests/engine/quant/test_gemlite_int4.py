"""GemLite INT4 (engine.quant.gemlite_int4) against our torch reference, and Int4Linear's CUDA kernel choice per M.
GemLite's kernel configs and their tuning: test_gemlite_tuning.py.

Without a CUDA device the kernels run in Triton's interpreter (tests/engine/gemlite_testing.py says how and
what it cannot run).

Tolerance, from the arithmetic: the kernel dequantizes w = fma(q, s, m) in the activation dtype (unit roundoff
u = 2^-8 for bf16, 2^-11 for fp16), the reference rounds the same w once (Int4Linear's `_Dequantizer`), so each
weight differs by at most one rounding (2u |w|) where the kernel's fma rounds differently; products accumulate in
fp32 (K * 2^-24 relative to sum |x||w|); the output is rounded to the dtype (u |y|). Bound per output element:
u |y| + (2u + K 2^-24) (|x| @ |w|^T). A wrong zero (z instead of z - 8s) breaks it by orders of magnitude (checked).
"""

from __future__ import annotations

from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from gemlite_testing import (
    DEVICE,
    GEMM_UNDER_INTERPRETER,
    INTERPRET,
    error_bound,
    gemlite_on_cpu,
    int4_weight,
    interpreter_bf16_cast_ok,
    triton,
)

from engine.quant import gemlite_int4, int4_kernel_plan
from engine.quant.int4_kernel_plan import cuda_kernel_plan, gemlite_kernel_for
from engine.quant.int4_linear import _Dequantizer


@pytest.fixture(scope="module")
def _gemlite_on_cpu() -> Iterator[None]:
    """gemlite_testing.gemlite_on_cpu for this module's tests."""
    yield from gemlite_on_cpu()


def test_gemlite_layout_is_our_weight(_gemlite_on_cpu: None) -> None:
    """GemLite's packed weight, scales and zeros, read back with GemLite's own unpack helper, are our weight: the
    same q, s and m = z - 8 s, so fma(q, s, m) is _Dequantizer's w (exactly, in fp32 arithmetic here)."""
    from gemlite.bitpack import unpack_over_cols_torch

    from engine.quant.qparams import unpack_uint4

    for group_size, dtype in ((32, torch.float16), (128, torch.bfloat16)):
        q = int4_weight(48, 256, group_size, seed=group_size)
        g = gemlite_int4.GemLiteInt4(q, dtype, DEVICE)
        lin = g.linear
        codes = unpack_over_cols_torch(lin.W_q.t().contiguous().cpu(), 4, q.padded_in_features)
        assert torch.equal(codes, unpack_uint4(q.qweight))
        deq = _Dequantizer(q, dtype, torch.device("cpu"))
        assert torch.equal(lin.scales.t().cpu(), deq.scales) and torch.equal(lin.zeros.t().cpu(), deq.mins)
        theirs = codes.view(48, -1, group_size).float() * lin.scales.t().cpu().float()[..., None] + \
            lin.zeros.t().cpu().float()[..., None]
        ours = deq.rows(None, torch.float32).view(48, -1, group_size)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
        assert theirs[0, 0].abs().max() == 0  # the all-zero group stays zero (no division by its scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, matmul_type", [(1, "GEMV_REVSPLITK"), (24, "GEMM_SPLITK"), (64, "GEMM")])
def test_gemlite_kernels_match_the_reference(_gemlite_on_cpu: None, m: int, matmul_type: str,
                                             dtype: torch.dtype) -> None:
    """Each of GemLite's INT4 kernels (the one get_matmul_type picks for M) against x @ w^T in fp32 with w the
    dtype-rounded dequantized weight, within the derived bound; the same kernel fed a wrong zero point fails it."""
    if INTERPRET and matmul_type == "GEMM":
        pytest.skip(GEMM_UNDER_INTERPRETER)
    if INTERPRET and dtype == torch.bfloat16 and not interpreter_bf16_cast_ok():
        pytest.skip(f"triton {triton.__version__}'s interpreter casts int32 to bfloat16 by reinterpreting the bits "
                    "(1 -> 9.2e-41), which garbles any kernel's int -> bf16 dequantization; bf16 runs on a GPU")
    n, k, group_size = 64, 256, 64
    q = int4_weight(n, k, group_size, seed=m)
    g = gemlite_int4.GemLiteInt4(q, dtype, DEVICE)
    assert g.matmul_type(m) == matmul_type
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)).to(dtype)
    w = _Dequantizer(q, dtype, torch.device("cpu")).rows(None, dtype).float()
    ref = x.float() @ w.t()
    y = g(x.to(DEVICE)).float().cpu()
    assert y.shape == (m, n)
    assert ((y - ref).abs() <= error_bound(x.float(), w, ref, dtype)).all(), (y - ref).abs().max()
    # Negative control: GemLite's zeros set to our z (the tinygemm zero) instead of m = z - 8 s.
    with torch.no_grad():
        g.linear.zeros.copy_(q.zeros.t().to(g.linear.zeros))
    bad = g(x.to(DEVICE)).float().cpu()
    assert not ((bad - ref).abs() <= error_bound(x.float(), w, ref, dtype)).all()


def test_gemlite_rejects_fp32_and_names_the_fix(_gemlite_on_cpu: None) -> None:
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemlite_int4.GemLiteInt4(int4_weight(16, 64, 32, seed=0), torch.float32, DEVICE)


def test_missing_or_old_gemlite_is_one_line_with_the_fix() -> None:
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    with mock.patch("importlib.metadata.version", side_effect=missing):
        reason = gemlite_int4.gemlite_unavailable_reason()
        assert reason is not None and "not installed" in reason and "pip install" in reason and "\n" not in reason
        with pytest.raises(ImportError, match="not installed"):
            gemlite_int4.import_gemlite()
    with mock.patch("importlib.metadata.version", return_value="0.4.8"):
        assert "older than 0.6.0" in gemlite_int4.gemlite_unavailable_reason()
    with mock.patch("importlib.metadata.version", side_effect=lambda name: {"gemlite": "0.6.0"}.get(name, "3.3.1")):
        assert "needs triton >= 3.6.0, found 3.3.1" in gemlite_int4.gemlite_unavailable_reason()


def test_cuda_kernel_plan(caplog: pytest.LogCaptureFixture) -> None:
    """Int4Linear's CUDA kernels by dtype and gemlite's presence: gemlite between the tinygemm and dequantize
    crossovers; without gemlite the tinygemm + dequantize scheme, logged once; gemlite=True without it raises;
    fp32 never uses it."""
    ok, missing = None, "gemlite is not installed (pip install 'gemlite>=0.6', or tokenmill[cuda])"
    plan = cuda_kernel_plan(torch.bfloat16, 4096, "auto", "auto", None, ok)
    assert plan == (True, int4_kernel_plan.CUDA_TINYGEMM_MAX_ROWS, int4_kernel_plan.CUDA_GEMLITE_DEQUANT_MIN_ROWS)
    assert cuda_kernel_plan(torch.float16, 4096, 0, None, None, ok) == (True, 0, None)
    assert cuda_kernel_plan(torch.bfloat16, 4100, "auto", 512, None, ok) == (True, 0, 512)  # tinygemm tiles N by 8
    int4_kernel_plan._FALLBACK_LOGGED.clear()
    with caplog.at_level("WARNING", logger="engine.quant.int4_kernel_plan"):
        for _ in range(2):
            plan = cuda_kernel_plan(torch.bfloat16, 4096, "auto", "auto", None, missing)
            assert plan == (False, None, int4_kernel_plan.CUDA_DEQUANT_MIN_ROWS)
    assert len([r for r in caplog.records if "not installed" in r.getMessage()]) == 1
    with pytest.raises(ImportError, match="not installed"):
        cuda_kernel_plan(torch.bfloat16, 4096, "auto", "auto", True, missing)
    assert cuda_kernel_plan(torch.bfloat16, 4096, "auto", 32, False, ok) == (False, None, 32)
    assert cuda_kernel_plan(torch.float32, 4096, "auto", "auto", None, ok) == (False, None, 64)
    with pytest.raises(ValueError, match="fp32"):
        cuda_kernel_plan(torch.float32, 4096, "auto", "auto", True, ok)


def test_cuda_kernel_plan_of_the_single_layout() -> None:
    """Layout "single" keeps one packed copy: GemLite at every M below the dequantize crossover (no tinygemm), and
    without gemlite tinygemm alone (no dequantize path's copy) unless N rules tinygemm out; an unknown layout is an
    error naming the layouts."""
    ok, missing = None, "gemlite is not installed (pip install 'gemlite>=0.6', or tokenmill[cuda])"
    single = cuda_kernel_plan(torch.bfloat16, 4096, "auto", "auto", None, ok, "single")
    assert single == (True, 0, int4_kernel_plan.CUDA_GEMLITE_DEQUANT_MIN_ROWS)
    assert gemlite_kernel_for(1, *single[1:]) == "gemlite"
    assert cuda_kernel_plan(torch.bfloat16, 4096, "auto", "auto", None, missing, "single") == (False, None, None)
    assert cuda_kernel_plan(torch.float32, 4096, "auto", 0, None, ok, "single") == (False, None, 0)
    assert cuda_kernel_plan(torch.float32, 4100, "auto", "auto", None, ok, "single") == (False, None, 0)
    with pytest.raises(ValueError, match=r"\('dual', 'single'\)"):
        cuda_kernel_plan(torch.bfloat16, 4096, "auto", "auto", None, ok, "one")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 32, 128, 512, 2048])
def test_int4_linear_on_cuda_uses_gemlite_above_the_crossover(_gemlite_on_cpu: None, m: int) -> None:
    """On a GPU: Int4Linear (bf16) picks tinygemm up to CUDA_TINYGEMM_MAX_ROWS, GemLite above and GemLite's weight
    dequantized + the dense GEMM from CUDA_GEMLITE_DEQUANT_MIN_ROWS, each within the derived bound of the
    dequantized reference. GemLite (and its dequantized weight) rounds w = q s + m once (as the reference); tinygemm
    computes (q - 8) s + z its own way in bf16, up to two roundings of terms as large as |q s| + |m| each."""
    from engine.quant.int4_linear import Int4Linear
    from engine.quant.qparams import unpack_uint4

    q = int4_weight(512, 1024, 128, seed=m)
    lin = Int4Linear(q, torch.bfloat16, "cuda")
    plan = int4_kernel_plan
    kernel = gemlite_kernel_for(m, plan.CUDA_TINYGEMM_MAX_ROWS, plan.CUDA_GEMLITE_DEQUANT_MIN_ROWS)
    assert lin.kernel_for(m) == kernel
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    deq = _Dequantizer(q, torch.bfloat16, torch.device("cpu"))
    w = deq.rows(None, torch.bfloat16).float()
    ref = x.float() @ w.t()
    y = lin(x.cuda()).float().cpu()
    if kernel != "tinygemm":
        assert ((y - ref).abs() <= error_bound(x.float(), w, ref, torch.bfloat16)).all()
    else:
        codes = unpack_uint4(q.qweight).view(512, -1, 128).float()
        terms = (codes * deq.scales.float()[..., None]).abs() + deq.mins.float()[..., None].abs()
        assert ((y - ref).abs() <= error_bound(x.float(), terms.view(512, -1), ref, torch.bfloat16, 4.0)).all()


@pytest.mark.gpu
def test_int4_linear_single_layout_on_cuda_holds_one_copy(_gemlite_on_cpu: None) -> None:
    """On a GPU, layout "single": no tinygemm copy, GemLite at M 1 and 8 within the derived bound of the dequantized
    reference; the fused module (concat) joins the portable weights on the host, not on the GPU, and has none once
    released."""
    from engine.quant.int4_linear import Int4Linear, release_int4_sources

    q = int4_weight(512, 1024, 128, seed=3)
    lin = Int4Linear(q, torch.bfloat16, "cuda", layout="single")
    assert lin.packed is None and lin.dequantizer is None and lin.gemlite is not None
    deq = _Dequantizer(q, torch.bfloat16, torch.device("cpu"))
    w = deq.rows(None, torch.bfloat16).float()
    for m in (1, 8):
        assert lin.kernel_for(m) == "gemlite"
        x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        ref = x.float() @ w.t()
        y = lin(x.cuda()).float().cpu()
        assert ((y - ref).abs() <= error_bound(x.float(), w, ref, torch.bfloat16)).all()
    fused = Int4Linear.concat([lin, Int4Linear(int4_weight(256, 1024, 128, seed=4), torch.bfloat16, "cuda",
                                               layout="single")])
    assert fused.layout == "single" and fused.packed is None and fused.source.qweight.device.type == "cpu"
    assert release_int4_sources(torch.nn.Sequential(fused)) == 1 and fused.source is None
    assert Int4Linear.concat([fused, fused]) is None


def test_gemlite_kernel_for_each_m() -> None:
    """The kernel per row count M: tinygemm up to its crossover, dequantize + GEMM from its own, GemLite between;
    0 / None switch either off."""
    tiny, dequant = int4_kernel_plan.CUDA_TINYGEMM_MAX_ROWS, int4_kernel_plan.CUDA_GEMLITE_DEQUANT_MIN_ROWS
    assert [gemlite_kernel_for(m, tiny, dequant) for m in (1, tiny, tiny + 1, dequant - 1, dequant, 8192)] == [
        "tinygemm", "tinygemm", "gemlite", "gemlite", "dequant", "dequant"]
    assert gemlite_kernel_for(1, 0, dequant) == "gemlite"
    assert gemlite_kernel_for(8192, tiny, None) == "gemlite"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemlite_dequantize_is_the_reference_weight(_gemlite_on_cpu: None, dtype: torch.dtype) -> None:
    """GemLite's packed weight dequantized (the large-M path, no second copy) is _Dequantizer's weight, bit for
    bit: the same q, s and m = z - 8 s, one fused multiply-add in the activation dtype."""
    q = int4_weight(96, 512, 128, seed=7)
    g = gemlite_int4.GemLiteInt4(q, dtype, DEVICE)
    w = g.dequantize().cpu()
    assert w.shape == (96, 512) and w.dtype == dtype
    assert torch.equal(w, _Dequantizer(q, dtype, torch.device("cpu")).rows(None, dtype))
