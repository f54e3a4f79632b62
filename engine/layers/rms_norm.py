"""RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019), with the decoder's residual add fused in,
and the switch the model's layers share to the fused elementwise ops: the C++ kernels (engine.kernels.cpu_kernels) on
the
CPU, the Triton kernels (engine.kernels.triton_fused) on CUDA."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.kernels.cpu_kernels import cpu_ops
from engine.kernels.triton_fused import DTYPES as TRITON_DTYPES
from engine.kernels.triton_fused import triton_fused_ops


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """The fused ops (`rms_norm`, `add_rms_norm`, `silu_and_mul`, `rope_write_kv`, one contract) that can serve
    activation `x` with autograd off (they have no backward; GPTQ tuning trains through these modules): the C++
    kernels for a CPU tensor (engine.kernels.cpu_kernels.cpu_ops), the Triton kernels for a CUDA tensor of
    fp32/fp16/bf16
    (engine.kernels.triton_fused.triton_fused_ops). None otherwise, or where they are not available, and the torch ops
    run.
    Called per layer per step: the CPU branch is first and does what `fused_cpu_ops` does."""
    device = x.device.type
    if device == "cpu":
        return None if torch.is_grad_enabled() else cpu_ops()
    if device == "cuda" and x.dtype in TRITON_DTYPES and not torch.is_grad_enabled():
        return triton_fused_ops()
    return None


def fused_cpu_ops(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernels (engine.kernels.cpu_kernels) when they can serve `x`: a CPU tensor with autograd off (the kernels
    have no backward; GPTQ tuning trains through these modules). None otherwise, and the torch ops run. For the ops
    only the C++ module has (quantize_rows_u8 of engine.quant.int8_linear); the model's layers call `fused_ops`."""
    if x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return cpu_ops()


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 as HF transformers does. x: [..., hidden] -> same shape.

    With `residual` (same shape), normalizes residual + x instead and returns (normalized, residual + x): the
    decoder's skip connection fused into the norm, as vLLM's fused_add_rms_norm (one pass in the fused ops).

    With `offset` (Gemma: 1.0) the normalized x is multiplied by (offset + weight) in fp32 and then rounded to x's
    dtype, as HF transformers' GemmaRMSNorm (the weight is stored centred on 0, initialized to zeros); that form
    runs in torch (the fused kernels take the plain weight).
    """

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops(x) if not self.offset else None
        if ops is not None and x.dim() == 2 and self.weight.dtype == x.dtype:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if x.is_contiguous() and residual.is_contiguous() and residual.dtype == x.dtype:
                out, total = ops.add_rms_norm(x, residual, self.weight, self.eps)
                return out, total
        if residual is not None:
            total = residual + x
            return self._norm(total), total
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)
