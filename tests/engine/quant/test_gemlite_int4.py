"""GemLite INT4 (engine.quant.gemlite_int4) against our torch reference, Int4Linear's CUDA kernel choice per M, and
GemLite's kernel configs: the per-GPU cache (its keying by GPU model and gemlite version, its refusal of a file
tuned elsewhere), the seed file of an aliased GPU, the warm-up plan over the engine's row counts and the tuning at
load (on the CPU with a stand-in benchmarker; for real on a GPU).

Without a CUDA device GemLite's kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before
triton is imported, as tests/engine/layers/test_triton_attention.py does). gemlite 0.6 cannot be imported on a machine
without CUDA as it ships: at import it reads the device (torch.cuda.get_device_capability / get_device_properties
in gemlite/triton_kernels/utils.py, core.py, quant_utils.py) and asks Triton's driver for its target
(triton.runtime.driver.active, "0 active drivers" on a CPU-only machine). `_gemlite_on_cpu` imports it with those
answered as an H100 would (sm_90, 132 SMs, 227 KiB of shared memory), and answers the autotuner's benchmark with
the first pruned config, so each shape runs one config. The interpreter's atomic add has no bf16 ("ValueError:
Unsupported data type" from interpreter.create_atomic_rmw), so there the split-K kernels accumulate bf16 output
through GemLite's fp32 buffer (`set_native_atomic_bfp16(False)`, its path on GPUs before sm_90), and Triton 3.9's
interpreter casts int32 to bfloat16 by reinterpreting the bits (1 -> 9.2e-41: `_interpreter_bf16_cast_ok` probes
it), which garbles GemLite's `q.to(meta_dtype)` dequantization: the bf16 kernel tests skip here while that holds
(the layout test covers bf16's packing; the GPU runs the kernels). Of GemLite's three INT4 kernels,
GEMV_REVSPLITK (M <= 4) and GEMM_SPLITK (4 < M < 64) run in the interpreter; GEMM (M >= 64) does not:
`k_m = (k * stride_mul).to(tl.int32)` (gemm_kernels.py) fails with "AttributeError: 'float' object has no
attribute 'to'" because the interpreter's `tl.range` yields Python ints where compiled Triton yields tensors, so
that test skips here, with that reason, and runs on a GPU (this file is a step of bench/gpu_session.sh). GEMM
reads the same packed weight, scales and zeros as the other two, which the layout test checks on any machine.

Tolerance, from the arithmetic: the kernel dequantizes w = fma(q, s, m) in the activation dtype (unit roundoff
u = 2^-8 for bf16, 2^-11 for fp16), the reference rounds the same w once (Int4Linear's `_Dequantizer`), so each
weight differs by at most one rounding (2u |w|) where the kernel's fma rounds differently; products accumulate in
fp32 (K * 2^-24 relative to sum |x||w|); the output is rounded to the dtype (u |y|). Bound per output element:
u |y| + (2u + K 2^-24) (|x| @ |w|^T). A wrong zero (z instead of z - 8s) breaks it by orders of magnitude (checked).
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
tl = pytest.importorskip("triton.language")

from engine.quant import gemlite_int4, int4_linear  # noqa: E402
from engine.quant.int4_linear import _Dequantizer, cuda_kernel_plan, gemlite_kernel_for  # noqa: E402
from engine.quant.qparams import Int4Weight, quantize_int4  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
GEMM_UNDER_INTERPRETER = ("gemlite's GEMM kernel (M >= 64) cannot run in Triton's interpreter: gemm_kernels.py "
                          "`k_m = (k * stride_mul).to(tl.int32)` raises AttributeError: 'float' object has no "
                          "attribute 'to' (the interpreter's tl.range yields Python ints); it runs on a GPU")


@triton.jit
def _cast_to_bf16(q_ptr, out_ptr):  # noqa: ANN001
    i = tl.arange(0, 4)
    tl.store(out_ptr + i, tl.load(q_ptr + i).to(tl.bfloat16))


def _interpreter_bf16_cast_ok() -> bool:
    """Whether this Triton's interpreter converts int32 0..3 to bfloat16 0..3 (3.9 reinterprets the bits)."""
    out = torch.empty(4, dtype=torch.bfloat16)
    _cast_to_bf16[(1,)](torch.arange(4, dtype=torch.int32), out)
    return out.tolist() == [0.0, 1.0, 2.0, 3.0]


class _FakeCudaDriver:
    """What gemlite asks Triton's driver, answered as an H100 would, for imports and autotuning on a CPU."""

    def __init__(self) -> None:
        self.utils = types.SimpleNamespace(
            get_device_properties=lambda device: {"max_shared_mem": 232448, "multiprocessor_count": 132})
        self.calls = 0

    def get_current_target(self) -> object:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_benchmarker(self) -> object:
        def bench(kernel_call: object, quantiles: object = None) -> list[float]:
            self.calls += 1  # never runs the kernel: the first config benchmarked is the fastest
            return [float(self.calls)] * 3
        return bench


@pytest.fixture(scope="module")
def _gemlite_on_cpu() -> Iterator[None]:
    """gemlite importable and its autotuner usable here: on a GPU, as installed; on a CPU, see the module docstring.
    Triton's active driver is put back afterwards."""
    if gemlite_int4.gemlite_unavailable_reason() is not None:
        pytest.skip(gemlite_int4.gemlite_unavailable_reason())
    if not INTERPRET:
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
        yield
        return
    from triton.runtime import driver

    saved = driver._active
    driver.set_active(_FakeCudaDriver())
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=132, major=9, minor=0)
    try:
        if "gemlite" not in sys.modules:
            with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
                    mock.patch("torch.cuda.get_device_properties", return_value=props), \
                    mock.patch("torch.cuda.device_count", return_value=0):
                import gemlite  # noqa: F401
        import gemlite

        gemlite.set_native_atomic_bfp16(False)
        yield
    finally:
        driver._active = saved
        if "gemlite" in sys.modules:
            sys.modules["gemlite"].set_native_atomic_bfp16(True)


def _weight(n: int, k: int, group_size: int, seed: int) -> Int4Weight:
    """Gaussian weights on the asymmetric INT4 grid, with one all-zero group (s = z = 0, as a GGUF Q4_0 block of
    zeros loads), so the mapping never divides by a scale."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    q = quantize_int4(w, group_size)
    q.scales[0, 0], q.zeros[0, 0] = 0.0, 0.0
    return q


def _bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
           weight_roundings: float = 2.0) -> torch.Tensor:
    """Per-element error bound of the module docstring: x [M, K], w [N, K] (the magnitude each weight's rounding is
    relative to: |w| for one rounding of w), ref [M, N]; `weight_roundings` units u of it per weight."""
    u = UNIT_ROUNDOFF[dtype]
    return u * ref.abs() + (weight_roundings * u + x.shape[1] * 2.0 ** -24) * (x.abs() @ w.abs().t())


def test_gemlite_layout_is_our_weight(_gemlite_on_cpu: None) -> None:
    """GemLite's packed weight, scales and zeros, read back with GemLite's own unpack helper, are our weight: the
    same q, s and m = z - 8 s, so fma(q, s, m) is _Dequantizer's w (exactly, in fp32 arithmetic here)."""
    from gemlite.bitpack import unpack_over_cols_torch

    from engine.quant.qparams import unpack_uint4

    for group_size, dtype in ((32, torch.float16), (128, torch.bfloat16)):
        q = _weight(48, 256, group_size, seed=group_size)
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
    if INTERPRET and dtype == torch.bfloat16 and not _interpreter_bf16_cast_ok():
        pytest.skip(f"triton {triton.__version__}'s interpreter casts int32 to bfloat16 by reinterpreting the bits "
                    "(1 -> 9.2e-41), which garbles any kernel's int -> bf16 dequantization; bf16 runs on a GPU")
    n, k, group_size = 64, 256, 64
    q = _weight(n, k, group_size, seed=m)
    g = gemlite_int4.GemLiteInt4(q, dtype, DEVICE)
    assert g.matmul_type(m) == matmul_type
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m)).to(dtype)
    w = _Dequantizer(q, dtype, torch.device("cpu")).rows(None, dtype).float()
    ref = x.float() @ w.t()
    y = g(x.to(DEVICE)).float().cpu()
    assert y.shape == (m, n)
    assert ((y - ref).abs() <= _bound(x.float(), w, ref, dtype)).all(), (y - ref).abs().max()
    # Negative control: GemLite's zeros set to our z (the tinygemm zero) instead of m = z - 8 s.
    with torch.no_grad():
        g.linear.zeros.copy_(q.zeros.t().to(g.linear.zeros))
    bad = g(x.to(DEVICE)).float().cpu()
    assert not ((bad - ref).abs() <= _bound(x.float(), w, ref, dtype)).all()


def test_gemlite_rejects_fp32_and_names_the_fix(_gemlite_on_cpu: None) -> None:
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemlite_int4.GemLiteInt4(_weight(16, 64, 32, seed=0), torch.float32, DEVICE)


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
    assert plan == (True, int4_linear.CUDA_TINYGEMM_MAX_ROWS, int4_linear.CUDA_GEMLITE_DEQUANT_MIN_ROWS)
    assert cuda_kernel_plan(torch.float16, 4096, 0, None, None, ok) == (True, 0, None)
    assert cuda_kernel_plan(torch.bfloat16, 4100, "auto", 512, None, ok) == (True, 0, 512)  # tinygemm tiles N by 8
    int4_linear._FALLBACK_LOGGED.clear()
    with caplog.at_level("WARNING", logger="engine.quant.int4_linear"):
        for _ in range(2):
            plan = cuda_kernel_plan(torch.bfloat16, 4096, "auto", "auto", None, missing)
            assert plan == (False, None, int4_linear.CUDA_DEQUANT_MIN_ROWS)
    assert len([r for r in caplog.records if "not installed" in r.getMessage()]) == 1
    with pytest.raises(ImportError, match="not installed"):
        cuda_kernel_plan(torch.bfloat16, 4096, "auto", "auto", True, missing)
    assert cuda_kernel_plan(torch.bfloat16, 4096, "auto", 32, False, ok) == (False, None, 32)
    assert cuda_kernel_plan(torch.float32, 4096, "auto", "auto", None, ok) == (False, None, 64)
    with pytest.raises(ValueError, match="fp32"):
        cuda_kernel_plan(torch.float32, 4096, "auto", "auto", True, ok)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 32, 128, 512, 2048])
def test_int4_linear_on_cuda_uses_gemlite_above_the_crossover(_gemlite_on_cpu: None, m: int) -> None:
    """On a GPU: Int4Linear (bf16) picks tinygemm up to CUDA_TINYGEMM_MAX_ROWS, GemLite above and GemLite's weight
    dequantized + the dense GEMM from CUDA_GEMLITE_DEQUANT_MIN_ROWS, each within the derived bound of the
    dequantized reference. GemLite (and its dequantized weight) rounds w = q s + m once (as the reference); tinygemm
    computes (q - 8) s + z its own way in bf16, up to two roundings of terms as large as |q s| + |m| each."""
    from engine.quant.int4_linear import Int4Linear
    from engine.quant.qparams import unpack_uint4

    q = _weight(512, 1024, 128, seed=m)
    lin = Int4Linear(q, torch.bfloat16, "cuda")
    kernel = gemlite_kernel_for(m, int4_linear.CUDA_TINYGEMM_MAX_ROWS, int4_linear.CUDA_GEMLITE_DEQUANT_MIN_ROWS)
    assert lin.kernel_for(m) == kernel
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    deq = _Dequantizer(q, torch.bfloat16, torch.device("cpu"))
    w = deq.rows(None, torch.bfloat16).float()
    ref = x.float() @ w.t()
    y = lin(x.cuda()).float().cpu()
    if kernel != "tinygemm":
        assert ((y - ref).abs() <= _bound(x.float(), w, ref, torch.bfloat16)).all()
    else:
        codes = unpack_uint4(q.qweight).view(512, -1, 128).float()
        terms = (codes * deq.scales.float()[..., None]).abs() + deq.mins.float()[..., None].abs()
        assert ((y - ref).abs() <= _bound(x.float(), terms.view(512, -1), ref, torch.bfloat16, 4.0)).all()


def test_gemlite_kernel_for_each_m() -> None:
    """The kernel per row count M: tinygemm up to its crossover, dequantize + GEMM from its own, GemLite between;
    0 / None switch either off."""
    tiny, dequant = int4_linear.CUDA_TINYGEMM_MAX_ROWS, int4_linear.CUDA_GEMLITE_DEQUANT_MIN_ROWS
    assert [gemlite_kernel_for(m, tiny, dequant) for m in (1, tiny, tiny + 1, dequant - 1, dequant, 8192)] == [
        "tinygemm", "tinygemm", "gemlite", "gemlite", "dequant", "dequant"]
    assert gemlite_kernel_for(1, 0, dequant) == "gemlite"
    assert gemlite_kernel_for(8192, tiny, None) == "gemlite"


def test_shipped_config_name_follows_gemlite_then_the_aliases() -> None:
    shipped = ["h100", "a100", "l40", "l40s", "l4", "4090"]
    assert gemlite_int4.shipped_config_name("NVIDIA H100 80GB HBM3", shipped) == "h100"
    assert gemlite_int4.shipped_config_name("NVIDIA L40S", shipped) == "l40s"  # gemlite's rule: longest name first
    assert gemlite_int4.shipped_config_name("NVIDIA H200", shipped) == "h100"  # none shipped: the same chip's
    assert gemlite_int4.shipped_config_name("NVIDIA GH200 480GB", shipped) == "h100"
    assert gemlite_int4.shipped_config_name("NVIDIA B200", shipped) is None
    assert gemlite_int4.shipped_config_name("NVIDIA H200", ["a100"]) is None  # the alias's file is not shipped


def test_config_cache_is_keyed_by_gpu_and_gemlite_and_refuses_another(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One cache file per GPU model and gemlite version, under the tokenmill cache root; a file tuned for another
    GPU or gemlite version, or not a cache at all, is refused with a one-line ValueError naming the fix."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    path = gemlite_int4.config_cache_path("NVIDIA H200", "0.6.0.post2")
    assert path.parent == tmp_path / "gemlite" and "nvidia-h200" in path.name and "0.6.0.post2" in path.name
    assert len({path, gemlite_int4.config_cache_path("NVIDIA H100 80GB HBM3", "0.6.0.post2"),
                gemlite_int4.config_cache_path("NVIDIA H200", "0.6.1")}) == 3
    assert gemlite_int4.read_config_cache(path, "NVIDIA H200", "0.6.0.post2") is None  # none yet
    configs = {"GEMM_SPLITK": {"(16, 28672, 4096, 128, 8, 104)": {"BLOCK_SIZE_M": 16, "SPLIT_K": 16,
                                                                  "num_warps": 4, "num_stages": 1}}}
    assert gemlite_int4.write_config_cache(path, "NVIDIA H200", "0.6.0.post2", configs)
    assert gemlite_int4.read_config_cache(path, "NVIDIA H200", "0.6.0.post2") == configs
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    for device, version, what in (("NVIDIA H100 80GB HBM3", "0.6.0.post2", "NVIDIA H200"),
                                  ("NVIDIA H200", "0.6.1", "0.6.0.post2")):
        with pytest.raises(ValueError, match="delete the file to retune") as e:
            gemlite_int4.read_config_cache(path, device, version)
        assert what in str(e.value) and "\n" not in str(e.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a GemLite config cache"):
        gemlite_int4.read_config_cache(path, "NVIDIA H200", "0.6.0.post2")
    gemlite_int4.write_config_cache(path, "NVIDIA H200", "0.6.0.post2", {"GEMM_FUTURE": {}})
    with pytest.raises(ValueError, match="GEMM_FUTURE"):
        gemlite_int4.read_config_cache(path, "NVIDIA H200", "0.6.0.post2")


def test_warmup_rows_cover_every_kernel_and_m_bucket(_gemlite_on_cpu: None) -> None:
    """The warm-up calls for M 1..2048 with the engine's thresholds: one (kernel, gemlite M bucket) per key, run at
    its largest and smallest M; nothing where tinygemm or dequantize serve."""
    from gemlite.core import get_matmul_type
    from gemlite.triton_kernels.utils import get_closest_m

    tiny, dequant = int4_linear.CUDA_TINYGEMM_MAX_ROWS, int4_linear.CUDA_GEMLITE_DEQUANT_MIN_ROWS
    plan = gemlite_int4.warmup_rows(
        range(1, 2049), lambda m: get_matmul_type(m, 4) if gemlite_kernel_for(m, tiny, dequant) == "gemlite" else None,
        get_closest_m)
    assert plan[("GEMM_SPLITK", 16)] == [16, 9]
    assert plan[("GEMM_SPLITK", 64)] == [63, 49] and plan[("GEMM", 64)] == [64]  # M 64 leaves split-K
    assert plan[("GEMM", 128)] == [128, 97] and plan[("GEMM", 2048)] == [2047, 1537]
    covered = {m for ms in plan.values() for m in ms}
    assert min(covered) == tiny + 1 and max(covered) == dequant - 1
    for m in (9, 24, 100, 1000, 2047):  # every M served by GemLite falls in a warmed key
        assert (get_matmul_type(m, 4), get_closest_m(m)) in plan
    assert not any(k == "GEMV_REVSPLITK" for k, _ in plan)  # M <= 4 is tinygemm's here


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemlite_dequantize_is_the_reference_weight(_gemlite_on_cpu: None, dtype: torch.dtype) -> None:
    """GemLite's packed weight dequantized (the large-M path, no second copy) is _Dequantizer's weight, bit for
    bit: the same q, s and m = z - 8 s, one fused multiply-add in the activation dtype."""
    q = _weight(96, 512, 128, seed=7)
    g = gemlite_int4.GemLiteInt4(q, dtype, DEVICE)
    w = g.dequantize().cpu()
    assert w.shape == (96, 512) and w.dtype == dtype
    assert torch.equal(w, _Dequantizer(q, dtype, torch.device("cpu")).rows(None, dtype))


def test_tune_gemlite_tunes_once_and_caches_per_gpu(_gemlite_on_cpu: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """tune_gemlite at engine load: the keys no config covers are autotuned (here by the stand-in benchmarker),
    written under gemlite's own signatures (gemlite_signature is the key its kernels look up), and a second load
    tunes nothing: it reads the cache. An H200 is seeded with gemlite's shipped H100 file."""
    import copy
    import json

    import gemlite.core

    if not INTERPRET:
        pytest.skip("runs gemlite's autotuner with a stand-in benchmarker; the GPU test below tunes for real")
    monkeypatch.setattr(gemlite.core, "GEMLITE_TRITON_CONFIG_CACHE",
                        copy.deepcopy(gemlite.core.GEMLITE_TRITON_CONFIG_CACHE))
    g = gemlite_int4.GemLiteInt4(_weight(128, 256, 64, seed=3), torch.float16, DEVICE)
    cache = tmp_path / "h200.json"
    args = ([g, g], [1, 2, 24], lambda layer, m: m != 2)
    done = gemlite_int4.tune_gemlite(*args, device_name="NVIDIA H200", cache=cache)
    assert (done.keys, done.tuned, done.written) == (2, 2, cache)
    assert any(p.endswith("h100.json") for p in done.loaded)
    saved = json.loads(cache.read_text())
    assert saved["meta"]["device"] == "NVIDIA H200"
    for m, kernel in ((1, "GEMV_REVSPLITK"), (24, "GEMM_SPLITK")):
        assert gemlite_int4.gemlite_signature(g, m) in saved["configs"][kernel]
    again = gemlite_int4.tune_gemlite(*args, device_name="NVIDIA H200", cache=cache)
    assert (again.keys, again.tuned, again.written) == (2, 0, None) and str(cache) in again.loaded
    with pytest.raises(ValueError, match="autotune"):
        gemlite_int4.tune_gemlite(*args, device_name="NVIDIA H200", cache=cache, autotune="slow")


@pytest.mark.gpu
def test_prepare_int4_kernels_tunes_at_load_then_reads_the_cache(_gemlite_on_cpu: None, tmp_path: Path) -> None:
    """On a GPU: the engine-load step tunes every (kernel, M bucket) of each layer shape GemLite serves in M 1..256
    (shapes no shipped file has), writes the cache, and a second load tunes nothing."""
    if INTERPRET:
        pytest.skip("needs a CUDA device: Int4Linear builds GemLite's kernels on cuda only")
    from gemlite.core import get_matmul_type
    from gemlite.triton_kernels.utils import get_closest_m
    from torch import nn

    from engine.quant.int4_linear import Int4Linear, prepare_int4_kernels

    model = nn.Sequential(Int4Linear(_weight(512, 1024, 128, seed=1), torch.bfloat16, "cuda"),
                          Int4Linear(_weight(1024, 512, 128, seed=2), torch.bfloat16, "cuda"))
    lin = model[0]
    keys = gemlite_int4.warmup_rows(range(1, 257), lambda m: get_matmul_type(m, 4) if lin.kernel_for(m) == "gemlite"
                                    else None, get_closest_m)
    cache = tmp_path / "gpu.json"
    first = prepare_int4_kernels(model, 256, cache=cache)
    assert (first.keys, first.written) == (2 * len(keys), cache) and first.tuned > 0
    second = prepare_int4_kernels(model, 256, cache=cache)
    assert (second.keys, second.tuned, second.written) == (2 * len(keys), 0, None)
    assert prepare_int4_kernels(nn.Sequential(nn.Linear(4, 4)), 256) is None  # nothing runs GemLite


def test_prepare_int4_kernels_warms_only_the_m_gemlite_serves(_gemlite_on_cpu: None, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine-load step on the CPU: an fp16 Int4Linear given GemLite's kernels as on CUDA (interpreter) with
    dequantize from M 6; prepare_int4_kernels(max_rows=8) warms GEMV_REVSPLITK at M 1, 2, 4 and GEMM_SPLITK's bucket
    8 at M 5 only (6-8 are dequantize's), once for two layers of one shape, and writes them under the GPU's name."""
    import copy
    import json

    import gemlite.core
    from torch import nn

    from engine.quant.int4_linear import Int4Linear, prepare_int4_kernels

    if not INTERPRET:
        pytest.skip("the CPU stand-in of the GPU test below")
    monkeypatch.setattr(gemlite.core, "GEMLITE_TRITON_CONFIG_CACHE",
                        copy.deepcopy(gemlite.core.GEMLITE_TRITON_CONFIG_CACHE))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    q = _weight(64, 256, 64, seed=11)
    layers = []
    for _ in range(2):
        lin = Int4Linear(q, torch.float16, "cpu")
        lin.gemlite, lin.dequant_min_rows = gemlite_int4.GemLiteInt4(q, torch.float16, "cpu"), 6
        layers.append(lin)
    assert [layers[0].kernel_for(m) for m in (1, 5, 6)] == ["gemlite", "gemlite", "dequant"]
    cache = tmp_path / "h200.json"
    done = prepare_int4_kernels(nn.Sequential(*layers), 8, cache=cache)
    assert (done.keys, done.written) == (4, cache)
    configs = json.loads(cache.read_text())["configs"]
    g = layers[0].gemlite
    for m, kernel in ((1, "GEMV_REVSPLITK"), (2, "GEMV_REVSPLITK"), (4, "GEMV_REVSPLITK"), (5, "GEMM_SPLITK")):
        assert gemlite_int4.gemlite_signature(g, m) in configs[kernel]
    assert prepare_int4_kernels(nn.Sequential(Int4Linear(q, torch.float16, "cpu")), 8) is None  # no GemLite here
