"""Merging linear projections into one GEMM: Q/K/V into qkv_proj, gate/up into gate_up_proj (the serving layout); a
linear's output with its GELU, or with the residual add and LayerNorm after it, in one pass (an encoder's MLP and
post-LN blocks)."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_kernels import encoder_fp32_ops
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


def _plain_linear_ops(module: nn.Module, x: torch.Tensor) -> ModuleType | None:
    """The C++ encoder kernels (engine.kernels.cpu_kernels.encoder_fp32_ops) when `module` is a plain biased
    nn.Linear (no GGUF blocks) of N % 8 == 0 outputs and x a contiguous [T, K] they serve; else None."""
    if type(module) is not nn.Linear or module.bias is None or module._modules or module.out_features % 8 or \
            x.dim() != 2 or not x.is_contiguous():
        return None
    return encoder_fp32_ops(x)


def linear_gelu(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """GELU (exact, erf) of module(x): x [..., K] -> [..., N] in the module's dtype, through the module's own fused
    epilogue when it has one (engine.quant.packed_linear.PackedLinear.forward_gelu: the CPU's oneDNN GEMM); for a
    plain fp32 nn.Linear where the C++ encoder kernels serve, the GEMM without its bias, then bias and GELU in one
    pass in place (bias_gelu_); else GELU in place on the module's fresh output (no second [..., N] tensor
    written)."""
    fused = getattr(module, "forward_gelu", None)
    if fused is not None:
        return fused(x)
    ops = _plain_linear_ops(module, x)
    if ops is not None:
        return ops.bias_gelu_(F.linear(x, module.weight), module.bias)
    return torch.ops.aten.gelu_(module(x))


def linear_add_layer_norm(module: nn.Module, norm: nn.LayerNorm, x: torch.Tensor,
                          residual: torch.Tensor) -> torch.Tensor:
    """norm(module(x) + residual), post-LN BERT's BertSelfOutput and BertOutput: x [T, K], residual [T, N] -> [T, N]
    in the module's dtype. For a plain fp32 nn.Linear and an affine, biased LayerNorm where the C++ encoder kernels
    serve: the GEMM without its bias, then bias, residual and LayerNorm in one pass in place
    (bias_residual_layer_norm_); else the torch ops."""
    ops = _plain_linear_ops(module, x)
    if ops is not None and type(norm) is nn.LayerNorm and norm.weight is not None and norm.bias is not None and \
            norm.normalized_shape == (module.out_features,) and \
            residual.is_contiguous() and residual.dtype == torch.float32:
        return ops.bias_residual_layer_norm_(F.linear(x, module.weight), module.bias, residual, norm.weight,
                                             norm.bias, norm.eps)
    return norm(module(x) + residual)
