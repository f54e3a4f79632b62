"""INT8 W8A8 linear layers for the CPU: int8 weights per output channel, int8 activations per token, dynamic.

The scheme is LLM.int8()'s vector-wise quantization without its outlier split (Dettmers et al., 2022) and
SmoothQuant's "W8A8 per-token dynamic" baseline (Xiao et al., 2023), as in vLLM's int8 W8A8 path: each weight row n
gets a scale s_w[n] = max|W[n, :]| / 127, each activation row m a scale s_x[m] = max|x[m, :]| / 127 computed at run
time, and y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] * q_w[n, k] with an int32 sum.

The GEMM is oneDNN's int8 inner product through torch's `onednn::qlinear_pointwise` (the op Inductor's x86 int8
lowering calls; schema in torch 2.13: `qlinear_pointwise(Tensor qx, float x_scale, int x_zero_point, Tensor qw,
Tensor w_scale, Tensor w_zero_point, Tensor? bias, float output_scale, int output_zero_point, ScalarType?
output_dtype, str post_op_name, Scalar?[] post_op_args, str post_op_algorithm)`, weight packed once by
`onednn::qlinear_prepack(int8 [N, K], x_shape)`). That op takes one activation scale per tensor, so it runs with
x_scale = 1 and the per-token scales multiply its fp32 output rows afterwards: exactly per-token quantization, and a
row's result never depends on the other rows in the batch (fbgemm's `quantized::linear_dynamic` picks one scale
for the whole batch). Activations go in as uint8 with zero point 128 (q_x + 128), the u8 x s8 form that AVX2 and
AVX512-VNNI int8 instructions take.

NOTE: without VNNI (AVX2-only and AVX512F-only CPUs), oneDNN multiplies u8 x s8 with `vpmaddubsw`, which adds each
pair of products into a saturating int16: 2 x 255 x 127 = 64770 overflows 32767 and the sum is silently wrong (the
same limit is why fbgemm and PyTorch's x86 quantization use `reduce_range`). There the weights are quantized to 7 bits
(|q_w| <= 63: 2 x 255 x 63 = 32130 fits), which costs about twice the weight rounding error and never saturates.
`int8_weight_qmax()` finds which case this CPU is by running the op once on a saturating input.

Faster than the fp32 GEMM at M = 64-256 rows for SmolLM2's shapes, on AVX2 and on AVX512-VNNI CPUs (bench/README.md
"CPU kernels (microbenchmarks)" and "Figures once quoted in engine/'s docstrings").
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.layers.rms_norm import fused_cpu_ops
from engine.quant.qparams import Int8Weight

_QMAX = 127.0
_QMAX_NO_VNNI = 63.0  # 7-bit weights where u8 x s8 pair sums saturate at int16 (module docstring)
_ZERO_POINT = 128  # uint8 activations: q_x + 128


def int8_available() -> bool:
    """True when this torch build has the oneDNN int8 linear ops (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@functools.cache
def int8_weight_qmax() -> float:
    """Largest |q_w| the int8 GEMM of this CPU sums exactly: 127, or 63 where oneDNN's u8 x s8 pair products
    saturate at int16 (CPUs without VNNI; module docstring). Found by running the op once on the worst case
    (all activations 255, all weights 127) and comparing with the exact int32 sum. Raises ValueError as Int8Linear
    when the op is missing."""
    if not int8_available():
        raise ValueError("torch has no oneDNN int8 ops (int8_available() is False)")
    k, n = 64, 8
    packed = torch.ops.onednn.qlinear_prepack(torch.full((n, k), 127, dtype=torch.int8), None)
    qx = torch.full((1, k), 255, dtype=torch.uint8)
    y = torch.ops.onednn.qlinear_pointwise(qx, 1.0, _ZERO_POINT, packed, torch.ones(n),
                                           torch.zeros(n, dtype=torch.int64), None, 1.0, 0, torch.float32, "none",
                                           [], "")
    exact = float((255 - _ZERO_POINT) * 127 * k)
    return _QMAX if bool((y == exact).all()) else _QMAX_NO_VNNI


def quantize_weight_int8(weight: torch.Tensor, qmax: float = _QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: weight float [N, K] -> (int8 [N, K], fp32 scales [N]); w ~ q * scale,
    |q| <= qmax (127, or 63 for CPUs whose int8 GEMM saturates: `int8_weight_qmax`)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / qmax
    q = torch.round(w / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token INT8 as uint8 with zero point 128: x float [M, K] -> (uint8 [M, K], fp32 scales [M, 1])."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(_QMAX)
    q = torch.round(x / scale).add_(_ZERO_POINT).to(torch.uint8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x W^T in W8A8 (see the module docstring), no bias.

    Args:
        weight: float [N, K] (N = out_features, K = in_features), quantized here per output channel; or an
            Int8Weight, whose integers and scales are used as they are (no second quantization).
        dtype: the activations' dtype (fp32 or bf16); the output has the input's dtype.
    forward: x [..., K] -> [..., N]. The weight is packed for oneDNN at the first forward (until then `concat` can
    merge modules: the fused serving layout of stored INT8 weights).
    Raises ValueError when torch has no oneDNN int8 ops (int8_available()), the weight is not 2-D on the CPU, or an
    Int8Weight holds values beyond what this CPU's int8 GEMM sums exactly (|q| <= int8_weight_qmax()).
    """

    def __init__(self, weight: torch.Tensor | Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        if not int8_available():
            raise ValueError("quantization='int8' needs torch's oneDNN int8 ops (a CPU build with mkldnn); use "
                             "quantization='none' or 'auto'")
        w = weight.qweight if isinstance(weight, Int8Weight) else weight
        if w.dim() != 2 or w.device.type != "cpu":
            raise ValueError(f"Int8Linear takes a 2-D CPU weight, got {tuple(w.shape)} on {w.device}")
        if isinstance(weight, Int8Weight):
            top = int(weight.qweight.abs().max()) if weight.qweight.numel() else 0
            if top > int8_weight_qmax():
                raise ValueError(f"stored int8 weights reach |q| = {top}, beyond the {int(int8_weight_qmax())} this "
                                 "CPU's int8 GEMM sums exactly (no VNNI); dequantize them instead")
        else:
            weight = Int8Weight(*quantize_weight_int8(weight, int8_weight_qmax()))
        self.out_features, self.in_features = w.shape
        self.dtype = dtype
        self.source: Int8Weight | None = weight
        self.packed: torch.Tensor | None = None
        self.weight_scale = weight.scale
        self.weight_zero_point = torch.zeros(self.out_features, dtype=torch.int64)

    @classmethod
    def concat(cls, modules: list[Int8Linear]) -> Int8Linear | None:
        """One Int8Linear whose output is the concatenation of `modules`' outputs (rows and scales stacked: exact,
        the scales are per row), or None when one is already packed or their input width or dtype differ."""
        first = modules[0]
        if any(m.source is None or (m.in_features, m.dtype) != (first.in_features, first.dtype) for m in modules):
            return None
        return cls(Int8Weight(torch.cat([m.source.qweight for m in modules]),
                              torch.cat([m.source.scale for m in modules])), first.dtype)

    def _pack(self) -> torch.Tensor:
        if self.packed is None:
            self.packed = torch.ops.onednn.qlinear_prepack(self.source.qweight, None)
            self.source = None  # the packed copy replaces it: one int8 copy of the weight
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        ops = fused_cpu_ops(x2)
        qx, sx = ops.quantize_rows_u8(x2) if ops is not None else quantize_activations_int8(x2)
        y = torch.ops.onednn.qlinear_pointwise(qx, 1.0, _ZERO_POINT, self._pack(), self.weight_scale,
                                               self.weight_zero_point, None, 1.0, 0, torch.float32, "none", [], "")
        return y.mul_(sx).to(x.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, W8A8 per-channel/per-token"


def quantize_model_int8(model: nn.Module) -> int:
    """Replace, in place, every decoder projection by an Int8Linear, and give every mixture-of-experts block's
    experts one Int8Linear per expert for gate/up and for down (GroupedExperts.set_gemms; the router and a shared
    expert's gate stay in the compute dtype, a shared expert is quantized as a dense MLP). The LM head and the
    embedding stay in the compute dtype: the logits are the most sensitive GEMM (INT8 there costs SmolLM2-135M
    perplexity for little throughput: bench/README.md "CPU kernels (microbenchmarks)", where each weight format
    wins). Fuse the projections first (ModelBase.fuse_projections) to get the serving layout. Returns the number of
    replaced modules (an expert block counts one). Raises ValueError as Int8Linear."""
    from engine.layers.moe import GroupedExperts
    from engine.quant.state import LM_HEAD, is_linear_weight, set_module

    dtype = model.embed_tokens.weight.dtype
    names = [name for name, m in model.named_modules()
             if type(m) is nn.Linear and is_linear_weight(f"{name}.weight") and name != LM_HEAD]
    for name in names:
        set_module(model, name, Int8Linear(model.get_submodule(name).weight, dtype))
    blocks = [m for m in model.modules() if isinstance(m, GroupedExperts) and m.gemms is None and m.int4 is None]
    for experts in blocks:
        gate_up, down = experts.stacked()
        experts.set_gemms([Int8Linear(w, dtype) for w in gate_up.detach()],
                          [Int8Linear(w, dtype) for w in down.detach()])
    return len(names) + len(blocks)
