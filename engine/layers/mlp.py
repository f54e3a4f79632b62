"""The gated MLP block: SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020) or GeGLU with tanh GELU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.linear import fuse_linears
from engine.layers.rms_norm import fused_ops


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), or GeGLU with cfg.hidden_act "gelu_pytorch_tanh" (gelu, tanh form);
    after `fuse()`, gate and up are one gate_up_proj GEMM. Its width is `intermediate_size` (default
    cfg.intermediate_size; a MoE's shared expert has its own)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = width = intermediate_size or cfg.intermediate_size
        self.silu = cfg.hidden_act == "silu"
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None

    def fuse(self) -> bool:
        """Replace gate_proj/up_proj by one gate_up_proj. Returns whether it fused (as Attention.fuse)."""
        return fuse_linears(self, ("gate_proj", "up_proj"), "gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            ops = fused_ops(gate_up) if self.silu else None
            if ops is not None and gate_up.dim() == 2:
                return self.down_proj(ops.silu_and_mul(gate_up))
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            return self.down_proj(self._act(gate) * up)
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) if self.silu else F.gelu(gate, approximate="tanh")
