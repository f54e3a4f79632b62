"""Linear layers with weights pre-packed for oneDNN on the CPU: the serving form of the model's GEMMs there.

`F.linear` on a CPU tensor reorders the weight into the GEMM library's blocked layout on every call (or goes
through MKL's sgemm for fp32, which is slower at these shapes). Packing it once, as PyTorch Inductor's CPU
freezing pass does (`torch.ops.mkldnn._reorder_linear_weight`, then `torch.ops.mkldnn._linear_pointwise`; both
in torch since 2.0), saves that work at every step. Measured on a 2-core AMD EPYC with AVX512-BF16 (torch
2.13.0+cpu, `python bench/cpu_kernels.py --gemm`, SmolLM2-135M's projection and LM-head shapes): bf16 at M = 64
rows 381-413 GFLOP/s packed vs 315-357 through F.linear; fp32 202-217 vs 106-172 (the LM head 2x).

bf16 results equal F.linear's bit for bit (both run oneDNN); fp32 ones differ from MKL's in rounding only
(relative 1e-7), because the two libraries sum in other orders.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.quant.state import set_module

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_available() -> bool:
    """True when this torch build has oneDNN (mkldnn) and its prepacked linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def bf16_packing_available() -> bool:
    """True when oneDNN can pack bf16 weights on this CPU: its bf16 reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT
    (AVX2-only CPUs have neither; there bf16 linears stay plain nn.Linear). Found by packing a tiny weight once."""
    if not packing_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def can_pack(dtype: torch.dtype) -> bool:
    """True when a CPU weight of `dtype` can be packed: fp32 wherever oneDNN is, bf16 per bf16_packing_available."""
    if dtype == torch.bfloat16:
        return bf16_packing_available()
    return dtype in PACKED_DTYPES and packing_available()


class PackedLinear(nn.Module):
    """y = x W^T (no bias) with W held in oneDNN's blocked layout.

    Args:
        weight: fp32 or bf16 [N, K] on the CPU (N = out_features, K = in_features); packed here, not kept.
    forward: x [..., K] of the weight's dtype -> [..., N].
    Raises ValueError for another device or dtype, a bias, a torch without oneDNN (packing_available()), or bf16 on a
    CPU whose oneDNN cannot pack it (bf16_packing_available()).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if not packing_available():
            raise ValueError("PackedLinear needs torch built with oneDNN (mkldnn); keep the nn.Linear")
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
            raise ValueError(f"PackedLinear takes a 2-D fp32/bf16 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        if not can_pack(weight.dtype):
            raise ValueError("oneDNN cannot pack bf16 weights on this CPU (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT); "
                             "keep the nn.Linear, or run in float32")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, None, "none", [], "")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, oneDNN packed"


def pack_linears(model: nn.Module) -> int:
    """Replace, in place, every plain nn.Linear of a CPU model whose weight is fp32 or bf16 by a PackedLinear (a
    tied LM head gets its own packed copy; the embedding is untouched; a bias is kept and added after the GEMM,
    engine.quant.state.set_module). Other modules (INT4, INT8) stay, and so do bf16 ones where oneDNN cannot pack
    bf16 (`can_pack`). Fuse projections first (they are packed as
    they stand). Returns the number replaced (0 when oneDNN is missing)."""
    if not packing_available():
        return 0
    names = [name for name, m in model.named_modules()
             if type(m) is nn.Linear and m.weight.device.type == "cpu"
             and m.weight.dtype in PACKED_DTYPES and can_pack(m.weight.dtype)]
    for name in names:
        set_module(model, name, PackedLinear(model.get_submodule(name).weight))
    return len(names)
