"""The mixture-of-experts experts on the GPU: two grouped-GEMM launches (engine/kernels/triton_moe_kernels.py) with
no host sync, so a MoE decode step is CUDA-graph capturable.

`fused_experts(x, gate_up, down, ids, weights)` computes what engine.layers.moe.GroupedExperts computes with its
per-expert loop: sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j]. Steps:
    1. `align_pairs`: the T * k (token, slot) pairs sorted by expert (stable: each expert's pairs keep token order),
       each expert's run padded to a multiple of BLOCK_M (vLLM's moe_align_block_size), all with torch ops on the
       device: counts by scatter_add_, offsets by cumsum, each BLOCK_M block's expert by searchsorted. The buffers
       are sized by the worst case (T * k + min(E, T * k) * (BLOCK_M - 1) entries), never by the counts.
    2. gate/up: one launch, [T * k, 2I] rows of x times their expert's gate_up [E, 2I, hidden].
    3. SiLU-and-mul ([T * k, I]; the fused Triton op where it serves, else torch).
    4. down: one launch, [T * k, hidden], each row multiplied by its routing weight.
    5. the sum over each token's k rows.
Experts with biases and another activation (gpt-oss: per-expert gate_up and down biases, the clamped SwiGLU) take
them as arguments (run_experts): each row's bias gathered by its expert and added after its GEMM, the activation a
torch callable in place of step 3.
Expert blocks past the used total return at once (the grid is sized by the worst case). No expert's weight is read
unless it has rows; experts with no rows cost nothing.

Triton is imported lazily, on the first call; without it (or with TOKENMILL_TRITON_MOE=0) `triton_moe_ops()` is None
and the torch path runs. Under TRITON_INTERPRET=1 (set before triton is first imported) the kernel runs in Triton's
interpreter on CPU tensors: the tests. Source: the fused-MoE form of vLLM (model_executor/layers/fused_moe) and
SGLang; Gale et al., "MegaBlocks" (2022).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch

from schemas import settings

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Blocks(NamedTuple):
    """The launch shape: rows per block of sorted pairs (BLOCK_M), output columns (BLOCK_N) and reduction depth
    (BLOCK_K) per program, and the kernel's warps and pipeline stages."""

    m: int
    n: int
    k: int
    warps: int = 4
    stages: int = 3


@functools.cache
def triton_moe_ops() -> ModuleType | None:
    """This module when its kernel can run: triton imports and TOKENMILL_TRITON_MOE is not "0"; else None (the torch
    path runs). Read once per process (tests call `triton_moe_ops.cache_clear()` after changing the variable). Only
    ImportError means "no triton": a broken install raises."""
    if not settings.env_flag(settings.TRITON_MOE):
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return sys.modules[__name__]


def blocks_for(num_pairs: int, num_experts: int) -> Blocks:
    """The launch shape for `num_pairs` (token, slot) pairs over `num_experts` experts: BLOCK_M near the expected
    rows per expert (16 for decode of a few tokens: padding costs little, 64 for large prefill steps), BLOCK_N and
    BLOCK_K 64. A function of the shapes only, so a captured step keeps it."""
    per_expert = num_pairs / max(num_experts, 1)
    m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    return Blocks(m=m, n=64, k=64, warps=4, stages=3 if m < 64 else 4)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs grouped by expert, each expert's run padded to a multiple of block_m.

    Args:
        ids: int64 [T, k] expert ids (engine.layers.moe.route), each in [0, num_experts).
        num_experts: E.
        block_m: the rows of one block.
    Returns:
        sorted_pairs int64 [capacity]: pair ids t * k + j, expert after expert (increasing), each expert's in
            increasing order, each run followed by padding entries equal to T * k up to a multiple of block_m;
            unused entries past the total are padding too. capacity = T*k + min(E, T*k) * (block_m - 1), rounded up
            to a multiple of block_m: the worst case, a function of the shapes only.
        block_expert int64 [capacity / block_m]: the expert of each block (num_experts - 1 past the total).
        padded_total int64 [1]: the used entries (a device tensor; nothing is read on the host).
    """
    flat = ids.reshape(-1)
    pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = (padded_end - padded)[expert_of] + torch.arange(pairs, device=dev) - start[expert_of]
    capacity = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int64, device=dev).index_copy_(0, dest, order)
    block_starts = torch.arange(0, capacity, block_m, dtype=torch.int64, device=dev)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert, padded_end[-1:]


#: One grouped-GEMM launch: (a, out, row_weights or None, align_pairs' tensors, a_row_div, blocks) -> None, writing
#: out [T * k, N] (`_grouped_gemm`'s arguments less the weight).
GroupedGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None,
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor], int, Blocks], None]
#: The experts' biases, (gate_up [E, 2I], down [E, hidden]) of the activations' dtype (run_experts).
Biases = tuple[torch.Tensor, torch.Tensor]
#: The experts' activation [T * k, 2I] -> [T * k, I] in place of SiLU-and-mul (run_experts).
Activation = Callable[[torch.Tensor], torch.Tensor]


def check_tensor(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype | None) -> None:
    """Raise ValueError unless t has `dim` dims, dtype `dtype` (when given) and a device the kernel runs on."""
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} dtype {t.dtype} does not match the activations' {dtype}")
    if (t.device.type == "cuda") == (settings.triton_interpret()):
        raise ValueError(f"{name} is on {t.device}: the Triton MoE kernel needs CUDA tensors (CPU tensors only under "
                         "TRITON_INTERPRET=1)")


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, row_weights: torch.Tensor | None,
                  aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a_row_div: int, blocks: Blocks) -> None:
    from engine.kernels import triton_moe_kernels

    sorted_pairs, block_expert, padded_total = aligned
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel() * -(-n // blocks.n),)
    triton_moe_kernels.grouped_gemm_kernel[grid](
        a, w, out, row_weights if row_weights is not None else out, sorted_pairs, block_expert, padded_total,
        n, k, out.shape[0], a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        out.stride(1), A_ROW_DIV=a_row_div, MUL_WEIGHT=row_weights is not None, IEEE=a.dtype == torch.float32,
        BF16_WORKAROUND=a.dtype == torch.bfloat16 and settings.triton_interpret(),
        BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k, num_warps=blocks.warps, num_stages=blocks.stages)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, blocks: Blocks | None = None, *, biases: Biases | None = None,
                  activation: Activation | None = None) -> torch.Tensor:
    """The experts' weighted sum for every token (module docstring), in two grouped-GEMM launches.

    Args:
        x: activations [T, hidden], fp32/fp16/bf16, CUDA (CPU under TRITON_INTERPRET=1).
        gate_up: stacked [E, 2I, hidden] (gate rows first, then up), x's dtype.
        down: stacked [E, hidden, I], x's dtype.
        ids: int64 [T, k] expert ids in [0, E) (engine.layers.moe.route).
        weights: [T, k] routing weights, x's dtype.
        blocks: the launch shape; default `blocks_for(T * k, E)`.
        biases, activation: the experts' biases and activation in place of SiLU-and-mul (run_experts).
    Returns:
        [T, hidden] of x's dtype: each token's k weighted expert outputs summed in slot order.
    Raises:
        ValueError for a shape, dtype or device the kernel does not serve, naming the tensor.
    """
    check_routing(x, ids, weights)
    for name, t in (("gate_up", gate_up), ("down", down)):
        check_tensor(name, t, 3, x.dtype)
    hidden = x.shape[1]
    num_experts, two_inter = gate_up.shape[0], gate_up.shape[1]
    if gate_up.shape[2] != hidden or two_inter % 2 or down.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit "
                         f"hidden {hidden}: want [E, 2I, {hidden}] and [E, {hidden}, I]")

    def gemm(w: torch.Tensor) -> GroupedGemm:
        return lambda a, out, row_weights, aligned, a_row_div, b: _grouped_gemm(a, w, out, row_weights, aligned,
                                                                                a_row_div, b)

    return run_experts(x, ids, weights, num_experts, two_inter, gemm(gate_up), gemm(down), blocks, biases=biases,
                       activation=activation)


def check_routing(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """Raise ValueError unless x is [T, hidden] of a served dtype (DTYPES) on the kernel's device, ids int64 [T, k]
    and weights [T, k] of x's dtype, beside it."""
    check_tensor("x", x, 2, None)
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype} not served by the Triton MoE kernel; want one of {DTYPES}")
    for name, t, dtype in (("ids", ids, torch.int64), ("weights", weights, x.dtype)):
        check_tensor(name, t, 2, dtype)
    if ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [{x.shape[0]}, k]")


def check_biases(biases: Biases | None, x: torch.Tensor, num_experts: int, two_inter: int) -> None:
    """Raise ValueError unless `biases` is None or (gate_up [E, 2I], down [E, hidden]) of x's dtype on its device."""
    if biases is None:
        return
    for name, t, shape in (("gate_up bias", biases[0], (num_experts, two_inter)),
                           ("down bias", biases[1], (num_experts, x.shape[1]))):
        check_tensor(name, t, 2, x.dtype)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} is {list(t.shape)}, want {list(shape)} (experts x output features)")


def run_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int, two_inter: int,
                gate_up: GroupedGemm, down: GroupedGemm, blocks: Blocks | None = None, *,
                biases: Biases | None = None, activation: Activation | None = None) -> torch.Tensor:
    """Steps 1-5 of the module docstring with the two launches `gate_up` (x -> [T * k, 2I]) and `down` ([T * k, I]
    -> [T * k, hidden], times the routing weights): the dense kernel's and engine.kernels.triton_moe_int4's.
    Inputs as fused_experts takes them, checked (check_routing, check_biases); returns [T, hidden] of x's dtype.

    biases: (gate_up [E, 2I], down [E, hidden]) of x's dtype, each (token, slot) row's expert's gathered and added
    after its GEMM (gpt-oss): the down rows get theirs before the routing weight, as the per-expert loop's
    (down(a) + b) * w (the down launch then multiplies no weight in). activation: [T * k, 2I] -> [T * k, I] in place
    of SiLU-and-mul (gpt-oss's clamped SwiGLU); None = SiLU-and-mul. No host sync either way."""
    check_biases(biases, x, num_experts, two_inter)
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    blocks = blocks or blocks_for(pairs, num_experts)
    aligned = align_pairs(ids, num_experts, blocks.m)
    h = torch.empty(pairs, two_inter, dtype=x.dtype, device=x.device)
    gate_up(x, h, None, aligned, top_k, blocks)
    flat = ids.reshape(-1)
    if biases is not None:
        h += biases[0].index_select(0, flat)
    act = _silu_and_mul(h) if activation is None else activation(h)
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    row_weights = weights.reshape(-1).contiguous()
    down(act, out, None if biases is not None else row_weights, aligned, 1, blocks)
    if biases is not None:
        out.add_(biases[1].index_select(0, flat)).mul_(row_weights[:, None])
    return out.view(tokens, top_k, hidden).sum(dim=1)


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h [P, 2I], the fused Triton op where it serves (engine.kernels.triton_fused), else torch."""
    from engine.kernels.triton_fused import triton_fused_ops

    ops = triton_fused_ops()
    if ops is not None:
        return ops.silu_and_mul(h)
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
