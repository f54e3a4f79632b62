"""INT4 GEMMs for every batch size on CUDA from GemLite (github.com/dropbox/gemlite, PyPI `gemlite`): Triton A16W4
kernels for small and large M, the ones TorchAO's GemliteUIntXWeightOnlyConfig and SGLang use.

Why GemLite and not a TorchAO int4 layout: TorchAO's `tile_packed_to_4d` is tinygemm (what Int4Linear already runs:
fast at M <= 8, slower than bf16 from M ~ 32 on an H100, bench/README.md "GPU"); its `plain` / `preshuffled`
formats run fbgemm-gpu-genai kernels, a compiled CUDA wheel built per torch release (our torch pin moves faster);
`marlin_sparse` needs 2:4-sparse weights; TorchAO's GemLite config wraps these same kernels. GemLite is pure Python
over Triton (already our GPU kernel stack), has a kernel per M regime, takes floating zero points (so our
asymmetric grid maps exactly, below) and runs partly in Triton's interpreter, so its layout is tested on the CPU
(tests/engine/quant/test_gemlite_int4.py).

Mapping of our Int4Weight (engine.quant.qparams, tinygemm's convention) to GemLite 0.6 (`GemLiteLinearTriton`):
- Ours: w[n, k] = (q - 8) * s[n, g] + z[n, g], q in 0..15, g = k // G (groups of G consecutive input features along
  K), s and z float [N, Kp/G]. Equivalently w = q * s + m with the group minimum m = z - 8 s.
- GemLite, W_group_mode 4 (`pack(..., fma_mode=True)`): w = fma(q, scales, zeros) = q * scales + zeros, computed
  in the meta dtype (= the activation dtype), scales and zeros [Kp/G, N] (ours transposed). So scales = s and
  zeros = m = z - 8 s, each computed in fp32 and rounded once to the activation dtype: the same numbers as
  Int4Linear's dequantize path (`_Dequantizer`: scale and min in the compute dtype, then one multiply-add).
  `pack` itself takes HQQ's zero (w = (q - zero) * scale) and stores -zero * scale; passing zero = 8 - z / s would
  divide by s (zero for an all-zero GGUF Q4_0 block) and round twice, so m is written into GemLite's zeros after
  pack (checked: W_group_mode 4 and the [Kp/G, N] shape, else a RuntimeError naming the gemlite version).
- Packing: our uint8 [N, Kp/2] (element 2j in the high nibble) is unpacked to uint8 [N, Kp] and packed by
  GemLite's own `pack` (32-bit packing, its default): int32 [Kp/8, N], element k at bits 4 * (k % 8) of word k // 8,
  contiguous (the layout conversion happens once, at load; never per step).
- Group size: GemLite takes any G >= 16 dividing in_features (a multiple of 32): ours are 32/64/128/256 and
  in_features = Kp (Int4Linear zero-pads the activations' K - Kp columns; the padding weights quantize zeros).
- Activations: bf16 -> DType.BF16, fp16 -> DType.FP16, output in the same dtype, fp32 accumulation (GemLite's
  default accumulator for both). fp32 activations are not sent here: Int4Linear keeps its exact fp32 path.
- Kernels by M (gemlite.core.get_matmul_type): M <= 4 GEMV_REVSPLITK, 4 < M < 64 GEMM_SPLITK, M >= 64 GEMM.

Kernel configs and their tuning at load, cached per GPU: engine.quant.gemlite_tuning.
"""

from __future__ import annotations

import importlib.metadata
from types import ModuleType

import torch

from engine.quant.qparams import Int4Weight, unpack_uint4

#: Oldest gemlite whose API and layout this module maps (pack(fma_mode=True), W_group_mode 4, DType.BF16).
GEMLITE_MIN_VERSION = "0.6.0"

#: gemlite 0.6's own requirement (its setup.py: triton>=3.6.0); installed with --no-deps it is not enforced.
TRITON_MIN_VERSION = "3.6.0"

#: The activation dtypes GemLite serves here.
GEMLITE_DTYPES = (torch.bfloat16, torch.float16)

def gemlite_unavailable_reason() -> str | None:
    """None when an installed gemlite is recent enough to serve INT4, else a one-line reason naming the fix."""
    from packaging.version import Version

    try:
        version = importlib.metadata.version("gemlite")
    except importlib.metadata.PackageNotFoundError:
        return "gemlite is not installed (pip install 'gemlite>=0.6', or tokenmill[cuda])"
    if Version(version) < Version(GEMLITE_MIN_VERSION):
        return f"gemlite {version} is older than {GEMLITE_MIN_VERSION} (pip install -U 'gemlite>=0.6')"
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return f"gemlite {version} needs triton, which is not installed (pip install 'triton>={TRITON_MIN_VERSION}')"
    if Version(triton) < Version(TRITON_MIN_VERSION):
        return f"gemlite {version} needs triton >= {TRITON_MIN_VERSION}, found {triton} (upgrade torch or triton)"
    return None


def import_gemlite() -> ModuleType:
    """The gemlite module. Raises ImportError (one line, with the fix) when it is missing or too old."""
    reason = gemlite_unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    import gemlite

    return gemlite


class GemLiteInt4:
    """One INT4 weight packed for GemLite's A16W4 kernels (the mapping is in the module docstring).

    A plain holder, not an nn.Module, so that the packed int32 weight is not a model parameter (Int4Linear keeps
    its packed forms as plain attributes too).

    Args:
        weight: Int4Weight, N = out_features, Kp = padded_in_features, G = group_size.
        dtype: activation dtype, bf16 or fp16.
        device: where the packed weight lives (cuda; cpu only under TRITON_INTERPRET=1, for tests).
    Call: x dtype [M, Kp] (contiguous) -> dtype [M, N].
    Raises ImportError when gemlite is missing or too old, ValueError for another dtype, RuntimeError when the
    installed gemlite packs differently from the mapping above.
    """

    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device | str) -> None:
        gemlite = import_gemlite()
        if dtype not in GEMLITE_DTYPES:
            raise ValueError(f"GemLite INT4 takes bf16 or fp16 activations, not {dtype}; use Int4Linear's fp32 path")
        device = torch.device(device)
        n, kp, g = weight.out_features, weight.padded_in_features, weight.group_size
        kind = gemlite.DType.BF16 if dtype == torch.bfloat16 else gemlite.DType.FP16
        linear = gemlite.GemLiteLinearTriton(4, group_size=g, in_features=kp, out_features=n, input_dtype=kind,
                                             output_dtype=kind)
        scales = weight.scales.to(device, torch.float32)
        mins = weight.zeros.to(device, torch.float32) - 8 * scales
        linear.pack(unpack_uint4(weight.qweight.to(device)), scales.to(dtype), torch.zeros_like(scales, dtype=dtype),
                    None, fma_mode=True)
        got = (linear.W_group_mode, linear.W_q.dtype, tuple(linear.W_q.shape), tuple(linear.scales.shape),
               tuple(linear.zeros.shape), linear.zeros.dtype)
        want = (4, torch.int32, (kp // 8, n), (kp // g, n), (kp // g, n), dtype)
        if got != want:
            raise RuntimeError(f"gemlite {gemlite.__version__} packed INT4 as (W_group_mode, W_q dtype/shape, scales, "
                               f"zeros shape/dtype) {got}, not {want} as engine/quant/gemlite_int4.py maps it; "
                               f"install gemlite 0.6 (pip install 'gemlite>=0.6,<0.7')")
        with torch.no_grad():
            linear.zeros.copy_(mins.t().to(dtype))
        self.linear, self.dtype = linear, dtype
        self.out_features, self.padded_in_features, self.group_size = n, kp, g

    def matmul_type(self, m: int) -> str:
        """GemLite's kernel for `m` rows: GEMV_REVSPLITK, GEMM_SPLITK or GEMM."""
        from gemlite.core import get_matmul_type

        return get_matmul_type(m, 4)

    def __call__(self, x: torch.Tensor, matmul_type: str | None = None) -> torch.Tensor:
        """x dtype [M, Kp] -> dtype [M, N]; `matmul_type` forces one of GemLite's kernels (tests, benchmarks)."""
        if matmul_type is None:
            return self.linear(x)
        return self.linear.forward_manual(x, matmul_type)

    def dequantize(self) -> torch.Tensor:
        """The weight as GemLite computes it, w = fma(q, scales, zeros) in the activation dtype: dtype [N, Kp],
        from GemLite's own packed int32 [Kp/8, N] (no second copy of the weight; the dequantize-then-GEMM path of
        large M uses it). Word k // 8 holds element k at bits 4 * (k % 8) (the layout checked at construction)."""
        w_q, scales, zeros = self.linear.W_q, self.linear.scales, self.linear.zeros
        kp, n, g = self.padded_in_features, self.out_features, self.group_size
        # Read as bytes (little-endian, as on x86 and NVIDIA GPUs): byte j of a word holds elements 2j (low nibble)
        # and 2j + 1, so the unpacking works on uint8 (a quarter of the int32 shifts' memory traffic).
        b = w_q.contiguous().view(torch.uint8).view(kp // 8, n, 4)
        q = torch.stack((b & 15, b >> 4), dim=-1).permute(0, 2, 3, 1).reshape(kp // g, g, n).to(self.dtype)
        return torch.addcmul(zeros[:, None, :], q, scales[:, None, :]).view(kp, n).t()
