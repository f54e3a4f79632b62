"""RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019), with the decoder's residual add fused in
on the CPU, and the switch to the C++ kernels (engine.cpu_kernels) that the model's layers share."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.cpu_kernels import cpu_ops


def fused_cpu_ops(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernels (engine.cpu_kernels) when they can serve `x`: a CPU tensor with autograd off (the kernels
    have no backward; GPTQ tuning trains through these modules). None otherwise, and the torch ops run."""
    if x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return cpu_ops()


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 as HF transformers does. x: [..., hidden] -> same shape.

    With `residual` (same shape), normalizes residual + x instead and returns (normalized, residual + x): the
    decoder's skip connection fused into the norm, as vLLM's fused_add_rms_norm (one pass on the CPU).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = fused_cpu_ops(x)
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
        return self.weight * x.to(dtype)
