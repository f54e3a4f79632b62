"""Merging linear projections into one GEMM: Q/K/V into qkv_proj, gate/up into gate_up_proj (the serving layout)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.gguf_holder import GGUFBlocksHolder


def concat_linears(modules: list[nn.Module]) -> nn.Module | None:
    """One module whose output is the concatenation of `modules`' outputs (along out_features), or None when they
    cannot be merged. All take the same input [..., K]; the merged one returns [..., sum(N_i)].

    Plain nn.Linear layers merge by concatenating their weights and biases (all with a bias or all without; as
    vLLM's QKVParallelLinear and MergedColumnParallelLinear hold Q/K/V and gate/up in one matrix; their GGUF
    blocks too, when every part has them: engine.layers.gguf_holder.GGUFBlocksHolder.concat); other module
    types merge through a `concat(modules)` classmethod of their own (e.g. engine.quant.int4_linear.Int4Linear,
    engine.quant.state.AddBias). The originals are not changed.
    """
    first = modules[0]
    if any(type(m) is not type(first) for m in modules):
        return None
    if type(first) is nn.Linear:
        biased = first.bias is not None
        if any((m.bias is not None) != biased or m.weight.dtype != first.weight.dtype
               or m.weight.device != first.weight.device or m.in_features != first.in_features for m in modules):
            return None
        weight = torch.cat([m.weight.detach() for m in modules])
        with torch.device("meta"):
            merged = nn.Linear(first.in_features, weight.shape[0], bias=biased)
        merged.weight = nn.Parameter(weight, requires_grad=False)
        if biased:
            merged.bias = nn.Parameter(torch.cat([m.bias.detach() for m in modules]), requires_grad=False)
        GGUFBlocksHolder.concat(modules, merged)  # the GGUF blocks of the parts, concatenated alike
        return merged
    concat = getattr(type(first), "concat", None)
    return concat(modules) if concat is not None else None


def fuse_linears(owner: nn.Module, parts: tuple[str, ...], fused: str) -> bool:
    """Replace the projections `parts` of `owner` (attribute names, e.g. q_proj, k_proj, v_proj) by one module
    `fused` (concat_linears: its output is theirs concatenated), in place; `owner.<fused>` is None until then.
    Returns whether it fused (False when already fused, or when the parts cannot be merged)."""
    if getattr(owner, fused) is not None:
        return False
    merged = concat_linears([getattr(owner, name) for name in parts])
    if merged is None:
        return False
    setattr(owner, fused, merged)
    for name in parts:
        delattr(owner, name)
    return True


def linear_gelu(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """GELU (exact, erf) of module(x): x [..., K] -> [..., N] in the module's dtype, through the module's own fused
    epilogue when it has one (engine.quant.packed_linear.PackedLinear.forward_gelu: the CPU's oneDNN GEMM), else
    GELU in place on the module's fresh output (no second [..., N] tensor written)."""
    fused = getattr(module, "forward_gelu", None)
    return fused(x) if fused is not None else torch.ops.aten.gelu_(module(x))
