"""Running GemLite's INT4 kernels and autotuner in tests (tests/engine/quant/test_gemlite_int4.py, kernels;
test_gemlite_tuning.py, configs): the CPU stand-ins, the test weights and the error bound.

Without a CUDA device GemLite's kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set before
triton is imported, as tests/engine/layers/test_triton_attention.py does). gemlite 0.6 cannot be imported on a machine
without CUDA as it ships: at import it reads the device (torch.cuda.get_device_capability / get_device_properties
in gemlite/triton_kernels/utils.py, core.py, quant_utils.py) and asks Triton's driver for its target
(triton.runtime.driver.active, "0 active drivers" on a CPU-only machine). `gemlite_on_cpu` imports it with those
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
that test skips here, with that reason, and runs on a GPU (the tests are a step of bench/gpu_session.sh). GEMM
reads the same packed weight, scales and zeros as the other two, which the layout test checks on any machine.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
tl = pytest.importorskip("triton.language")

from engine.quant.gemlite_int4 import gemlite_unavailable_reason  # noqa: E402
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


def interpreter_bf16_cast_ok() -> bool:
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


def gemlite_on_cpu() -> Iterator[None]:
    """gemlite importable and its autotuner usable here (a test module's fixture yields from it): on a GPU, as
    installed; on a CPU, see the module docstring. Triton's active driver is put back afterwards."""
    if gemlite_unavailable_reason() is not None:
        pytest.skip(gemlite_unavailable_reason())
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


def int4_weight(n: int, k: int, group_size: int, seed: int) -> Int4Weight:
    """Gaussian weights on the asymmetric INT4 grid, with one all-zero group (s = z = 0, as a GGUF Q4_0 block of
    zeros loads), so the mapping never divides by a scale."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    q = quantize_int4(w, group_size)
    q.scales[0, 0], q.zeros[0, 0] = 0.0, 0.0
    return q


def error_bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                weight_roundings: float = 2.0) -> torch.Tensor:
    """Per-element error bound of tests/engine/quant/test_gemlite_int4.py's docstring: x [M, K], w [N, K] (the
    magnitude each weight's rounding is relative to: |w| for one rounding of w), ref [M, N]; `weight_roundings`
    units u of it per weight."""
    u = UNIT_ROUNDOFF[dtype]
    return u * ref.abs() + (weight_roundings * u + x.shape[1] * 2.0 ** -24) * (x.abs() @ w.abs().t())
