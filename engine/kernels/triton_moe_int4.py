"""The INT4 (W4A16) mixture-of-experts experts on the GPU: engine.kernels.triton_moe's two grouped-GEMM launches
with the experts' weights in the portable INT4 format (engine.quant.stacked_int4.StackedInt4), dequantized in the
kernel (engine/kernels/triton_moe_int4_kernels.py): packed nibbles loaded, (q - 8) * scale + zero per group,
fp32 accumulation. No host sync, so a MoE decode step stays CUDA-graph capturable.

`fused_experts_int4(x, gate_up, down, ids, weights)` computes what triton_moe.fused_experts computes on the
dequantized weights: sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j], with the same
steps (triton_moe.run_experts: pairs sorted by expert and padded to BLOCK_M, the gate/up launch, SiLU-and-mul, the
down launch times the routing weights, the sum over each token's k rows). Act-order experts (StackedInt4.in_perm)
are served by gathering the activations' columns in the kernel. The weights are read once per BLOCK_M rows of an
expert: a quarter of the bf16 kernel's bytes (plus a scale and a zero per group), which is what decode, bound by
the weights' bytes, gains.

Available where triton_moe's kernel is (`triton_moe_int4_ops()`: the same TOKENMILL_TRITON_MOE switch); under
TRITON_INTERPRET=1 it runs in Triton's interpreter on CPU tensors (the tests). Sources: vLLM's fused_moe (its
fused_moe_kernel_gptq_awq for the in-kernel dequantization), tinygemm's INT4 convention (engine.quant.qparams).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Protocol, runtime_checkable

import torch

from engine.kernels.triton_moe import (
    Activation,
    Biases,
    Blocks,
    GroupedGemm,
    check_routing,
    check_tensor,
    run_experts,
    triton_moe_ops,
)
from schemas import settings


@runtime_checkable
class Int4Experts(Protocol):
    """What the kernel reads of stacked INT4 experts: the fields of engine.quant.stacked_int4.StackedInt4, the type
    to pass (named here by its fields only: engine.quant imports engine.kernels, so the kernels do not import it).
    qweight uint8 [E, N, Kp / 2], scales and zeros [E, N, Kp / group_size] of one float dtype, in_perm None or
    int64 [E, K]; num_experts E, out_features N, in_features K."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    in_features: int
    group_size: int
    in_perm: torch.Tensor | None

    @property
    def num_experts(self) -> int: ...

    @property
    def out_features(self) -> int: ...


def triton_moe_int4_ops() -> ModuleType | None:
    """This module when its kernel can run (exactly when triton_moe_ops() is not None: triton imports and
    TOKENMILL_TRITON_MOE is not "0"); else None and the caller runs its torch path."""
    return sys.modules[__name__] if triton_moe_ops() is not None else None


def int4_blocks(blocks: Blocks, group_size: int) -> Blocks:
    """`blocks` with BLOCK_K cut to group_size where it is larger (a K tile must lie in one group). Raises
    ValueError when BLOCK_K does not divide group_size."""
    k = min(blocks.k, group_size)
    if group_size % k:
        raise ValueError(f"BLOCK_K {blocks.k} does not divide the INT4 group size {group_size}; pick a power of two")
    return blocks._replace(k=k)


def _check_weight(name: str, w: Int4Experts, experts: int, out_features: int, in_features: int) -> None:
    """Raise ValueError unless w is a StackedInt4 of `experts` experts, [out_features, in_features] each, whose
    tensors are on the kernel's device, whose scales and zeros share strides (the kernel takes one set) and whose
    in_perm, if any, is int64 with unit stride along K."""
    if not isinstance(w, Int4Experts):
        raise ValueError(f"{name} must be a StackedInt4 (engine.quant.stacked_int4), got {type(w).__name__}")
    if (w.num_experts, w.out_features, w.in_features) != (experts, out_features, in_features):
        raise ValueError(f"{name} is [{w.num_experts}, {w.out_features}, {w.in_features}] experts x out x in; "
                         f"want [{experts}, {out_features}, {in_features}] for these activations")
    check_tensor(f"{name}.qweight", w.qweight, 3, torch.uint8)
    for part in ("scales", "zeros"):
        check_tensor(f"{name}.{part}", getattr(w, part), 3, None)
    if w.scales.stride() != w.zeros.stride():
        raise ValueError(f"{name}.scales and {name}.zeros must share a layout (strides {w.scales.stride()} and "
                         f"{w.zeros.stride()}); make both contiguous")
    if w.in_perm is not None:
        check_tensor(f"{name}.in_perm", w.in_perm, 2, torch.int64)
        if w.in_perm.stride(1) != 1:
            raise ValueError(f"{name}.in_perm must be contiguous along K (stride {w.in_perm.stride()})")


def fused_experts_int4(x: torch.Tensor, gate_up: Int4Experts, down: Int4Experts, ids: torch.Tensor,
                       weights: torch.Tensor, blocks: Blocks | None = None, *, biases: Biases | None = None,
                       activation: Activation | None = None) -> torch.Tensor:
    """The experts' weighted sum for every token (module docstring), in two grouped INT4 GEMM launches.

    Args:
        x: activations [T, hidden], fp32/fp16/bf16, CUDA (CPU under TRITON_INTERPRET=1).
        gate_up: StackedInt4 of E experts, [2I, hidden] each (gate rows first, then up), on x's device.
        down: StackedInt4 of E experts, [hidden, I] each.
        ids: int64 [T, k] expert ids in [0, E) (engine.layers.moe.route).
        weights: [T, k] routing weights, x's dtype.
        blocks: the launch shape; default triton_moe.blocks_for(T * k, E). Its BLOCK_K is cut to each weight's
            group size where larger (int4_blocks).
        biases: (gate_up [E, 2I], down [E, hidden]) of x's dtype, or None; activation: in place of SiLU-and-mul, or
            None (triton_moe.run_experts: gpt-oss's experts).
    Returns:
        [T, hidden] of x's dtype: each token's k weighted expert outputs summed in slot order.
    Raises:
        ValueError for a shape, dtype or device the kernel does not serve, naming the tensor.
    """
    check_routing(x, ids, weights)
    if not isinstance(gate_up, Int4Experts) or gate_up.out_features % 2:
        raise ValueError("gate_up must be a StackedInt4 of [2I, hidden] experts (gate rows, then up)")
    num_experts, two_inter = gate_up.num_experts, gate_up.out_features
    _check_weight("gate_up", gate_up, num_experts, two_inter, x.shape[1])
    _check_weight("down", down, num_experts, x.shape[1], two_inter // 2)

    def gemm(w: Int4Experts) -> GroupedGemm:
        return lambda a, out, row_weights, aligned, a_row_div, b: _grouped_gemm_int4(
            a, w, out, row_weights, aligned, a_row_div, int4_blocks(b, w.group_size))

    if blocks is not None:  # name a bad BLOCK_K before any work
        for w in (gate_up, down):
            int4_blocks(blocks, w.group_size)
    return run_experts(x, ids, weights, num_experts, two_inter, gemm(gate_up), gemm(down), blocks, biases=biases,
                       activation=activation)


def _grouped_gemm_int4(a: torch.Tensor, w: Int4Experts, out: torch.Tensor, row_weights: torch.Tensor | None,
                       aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a_row_div: int,
                       blocks: Blocks) -> None:
    from engine.kernels import triton_moe_int4_kernels

    sorted_pairs, block_expert, padded_total = aligned
    n = w.out_features
    grid = (block_expert.numel() * -(-n // blocks.n),)
    perm = w.in_perm
    interpret = settings.triton_interpret()
    triton_moe_int4_kernels.grouped_gemm_int4_kernel[grid](
        a, w.qweight, w.scales, w.zeros, perm if perm is not None else sorted_pairs, out,
        row_weights if row_weights is not None else out, sorted_pairs, block_expert, padded_total,
        n, w.in_features, out.shape[0], a.stride(0), a.stride(1), *w.qweight.stride(), *w.scales.stride(),
        perm.stride(0) if perm is not None else 0, out.stride(0), out.stride(1), GROUP_SIZE=w.group_size,
        A_ROW_DIV=a_row_div, MUL_WEIGHT=row_weights is not None, HAS_PERM=perm is not None,
        IEEE=a.dtype == torch.float32, BF16_WORKAROUND=a.dtype == torch.bfloat16 and interpret,
        BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k, num_warps=blocks.warps, num_stages=blocks.stages)
