"""The stacked weights of a mixture-of-experts block's experts (engine.layers.moe.GroupedExperts): one module per
projection holding every expert's weight [E, out, in] (and bias [E, out]), named as llama.cpp's converter names the
stacked tensors, and the GGUF blocks of gate and up joined when the block fuses them into one gate_up projection.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.gguf_blocks import GGUFBlocks


class ExpertWeights(nn.Module):
    """One projection of every expert, stacked: weight [E, out_features, in_features] and, with `bias`, bias
    [E, out_features] (a module so that its parameters are named "<projection>.weight" / ".bias", as llama.cpp's
    converter names the stacked tensors)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features)) if bias else None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> ExpertWeights:
        """The module holding `weight` [E, out, in] (and `bias` [E, out]) itself (no copy)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return module


def fuse_gate_up_blocks(gate: GGUFBlocks | None, up: GGUFBlocks | None, num_experts: int) -> GGUFBlocks | None:
    """The GGUF blocks of the fused gate_up [E, 2I, hidden] (rows [gate; up] per expert) from those of gate and up
    ([E * I, hidden] each), or None when either has none or their types differ."""
    if gate is None or up is None or gate.type_name != up.type_name:
        return None

    def join(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        if a is None or b is None:
            return None
        per_expert = [t.view(num_experts, -1, *t.shape[1:]) for t in (a, b)]
        return torch.cat(per_expert, dim=1).flatten(0, 1)

    return GGUFBlocks(gate.type_name, join(gate.qs, up.qs), join(gate.scales, up.scales), join(gate.mins, up.mins))
