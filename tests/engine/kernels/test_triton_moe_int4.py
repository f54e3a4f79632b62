"""The INT4 grouped-GEMM MoE experts (engine.kernels.triton_moe_int4) vs torch on the dequantized weights and vs the
dense Triton kernel (engine.kernels.triton_moe) on the same weights.

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 set at module
import, as test_triton_moe.py does). Shapes stay tiny and odd: hidden 136 and expert width 24 are no multiple of
the 16-wide blocks; hidden spans 5 / 3 / 2 groups of 32 / 64 / 128 (the last one partly padding) and the width is
padded to one whole group (Kp 32 / 64 / 128: most of its K tiles are padding). The routing sends most tokens to two
experts, a few to the others and none to expert UNUSED, whose weights are NaN: a kernel reading an expert without
rows would turn the output NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import torch.nn.functional as F  # noqa: E402
from triton_testing import compile_for_sm90, skip_without_a_backend  # noqa: E402

from engine.kernels import triton_moe, triton_moe_int4  # noqa: E402
from engine.kernels.triton_moe import Blocks, fused_experts  # noqa: E402
from engine.kernels.triton_moe_int4 import fused_experts_int4  # noqa: E402
from engine.layers.moe import route  # noqa: E402
from engine.quant.qparams import quantize_int4  # noqa: E402
from engine.quant.stacked_int4 import StackedInt4  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
HIDDEN, INTER, EXPERTS, TOP_K = 136, 24, 6, 2
UNUSED = 4
SMALL = Blocks(m=4, n=16, k=16, warps=1, stages=1) if INTERPRET else Blocks(m=16, n=16, k=16, warps=1, stages=1)


@pytest.fixture(autouse=True)
def _needs_a_backend() -> None:
    skip_without_a_backend("engine.kernels.triton_moe_int4_kernels", "grouped_gemm_int4_kernel")


@functools.cache
def _experts(group_size: int, act_order: bool = False) -> tuple[StackedInt4, StackedInt4]:
    """Random experts quantized at `group_size` (gate_up [2I, hidden], down [hidden, I] each; std 0.3 so that the
    SwiGLU outputs vary), on DEVICE; expert UNUSED's scales are NaN. With act_order the odd experts' columns are
    permuted (Int4Weight.in_perm) and the even ones keep input order."""
    g = torch.Generator().manual_seed(group_size)
    stacks = []
    for out_f, in_f in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        weights = []
        for e in range(EXPERTS):
            w = quantize_int4(torch.randn(out_f, in_f, generator=g) * 0.3, group_size, method="minmax")
            if e == UNUSED:
                w.scales.fill_(float("nan"))
            if act_order and e % 2:
                w = dataclasses.replace(w, in_perm=torch.randperm(in_f, generator=g))
            weights.append(w)
        stacks.append(StackedInt4.from_weights(weights).to(DEVICE))
    return stacks[0], stacks[1]


def _routing(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, HIDDEN], ids [T, k], weights [T, k]): route() on logits where experts 1 and 3 win for most tokens,
    every third token picks two of experts 0, 2 and 5, and expert UNUSED never wins."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g)
    logits = torch.randn(tokens, EXPERTS, generator=g)
    favored = torch.zeros(tokens, EXPERTS)
    favored[:, [1, 3]] = 10.0
    favored[::3] *= -1
    logits += favored
    logits[:, UNUSED] = -30.0
    weights, ids = route(logits, TOP_K, "softmax_topk", True)
    return x.to(DEVICE, dtype), ids.to(DEVICE), weights.to(DEVICE, dtype)


def _reference(x: torch.Tensor, gate_up: StackedInt4, down: StackedInt4, ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """Torch in fp64 on the dequantized weights: sum_j weights[t, j] * down_e(silu(gate_e(x)) * up_e(x)), as fp32."""
    gu, dn = gate_up.dequantize(torch.float64).cpu(), down.dequantize(torch.float64).cpu()
    x, ids, weights = x.cpu().double(), ids.cpu(), weights.cpu().double()
    h = torch.einsum("th,tjnh->tjn", x, gu[ids])
    act = F.silu(h[..., :INTER]) * h[..., INTER:]
    return torch.einsum("tji,tjni,tj->tn", act, dn[ids], weights).float()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("tokens", [1, 13])
def test_int4_experts_equal_torch_on_the_dequantized_weights_in_fp32(group_size: int, tokens: int) -> None:
    gate_up, down = _experts(group_size)
    x, ids, weights = _routing(tokens, torch.float32)
    assert UNUSED not in ids.flatten().tolist()
    counts = torch.bincount(ids.flatten().cpu(), minlength=EXPERTS).tolist()
    assert counts[1] == counts[3] == tokens - len(range(0, tokens, 3))  # T = 1: token 0 only, elsewhere
    out = fused_experts_int4(x, gate_up, down, ids, weights, SMALL)
    assert out.shape == (tokens, HIDDEN) and out.dtype == torch.float32 and out.device == x.device
    ref = _reference(x, gate_up, down, ids, weights)
    tol = 1e-5 if INTERPRET else 3e-5  # compiled: tl.dot sums its K tiles in another order (1.3e-5 seen on an H200)
    torch.testing.assert_close(out.cpu(), ref, rtol=tol, atol=tol)
    assert ref.abs().max() > 0.5  # the experts did something
    # the dense kernel on the dequantized weights: the same products, the same order
    dense = fused_experts(x, gate_up.dequantize().to(DEVICE), down.dequantize().to(DEVICE), ids, weights, SMALL)
    torch.testing.assert_close(out, dense, rtol=1e-6, atol=1e-6)


def test_act_order_experts_gather_the_activations_columns() -> None:
    gate_up, down = _experts(32, act_order=True)
    assert gate_up.in_perm is not None and down.in_perm is not None
    assert (gate_up.in_perm[0] == torch.arange(HIDDEN, device=DEVICE)).all()  # even experts: input order
    x, ids, weights = _routing(13, torch.float32)
    out = fused_experts_int4(x, gate_up, down, ids, weights, SMALL)
    torch.testing.assert_close(out.cpu(), _reference(x, gate_up, down, ids, weights), rtol=1e-5, atol=1e-5)


# bf16: the interpreter rounds fp32 -> bf16 by truncation (the GPU and torch round to nearest), four times here (the
# dequantized weights, h, the SiLU product, the outputs), all toward zero: measured 0.024-0.033 of the largest output
# (groups 32-128, T 5-19). fp16 measured 0.0006-0.0012.
@pytest.mark.parametrize(("dtype", "rel"), [(torch.bfloat16, 2 ** -4 if INTERPRET else 2 ** -5),
                                            (torch.float16, 2 ** -8)])
def test_half_activations_with_default_blocks(dtype: torch.dtype, rel: float) -> None:
    """bf16/fp16 activations against the fp64 result on the same inputs: within `rel` of its largest magnitude
    (the comment above). A wrong nibble, group or expert is off by the output's own size."""
    gate_up, down = _experts(64)
    x, ids, weights = _routing(13, dtype)
    out = fused_experts_int4(x, gate_up, down, ids, weights)
    assert out.dtype == dtype
    ref = _reference(x, gate_up, down, ids, weights)
    torch.testing.assert_close(out.cpu().float(), ref, rtol=0.0, atol=rel * ref.abs().max().item())


def test_int4_experts_name_what_they_cannot_serve() -> None:
    gate_up, down = _experts(64)
    x, ids, weights = _routing(3, torch.float32)
    with pytest.raises(ValueError, match="want \\[6, 136, 24\\]"):
        fused_experts_int4(x, gate_up, gate_up, ids, weights)
    with pytest.raises(ValueError, match="gate_up is \\[6, 48, 136\\]"):
        fused_experts_int4(x[:, :32], gate_up, down, ids, weights)
    with pytest.raises(ValueError, match="must be a StackedInt4"):
        fused_experts_int4(x, gate_up, down.dequantize().to(DEVICE), ids, weights)
    with pytest.raises(ValueError, match="ids dtype"):
        fused_experts_int4(x, gate_up, down, ids.int(), weights)
    with pytest.raises(ValueError, match="BLOCK_K 48 does not divide the INT4 group size 64"):
        fused_experts_int4(x, gate_up, down, ids, weights, Blocks(m=16, n=16, k=48))
    empty = fused_experts_int4(x[:0], gate_up, down, ids[:0], weights[:0])
    assert empty.shape == (0, HIDDEN)


def test_int4_ops_follow_the_triton_moe_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert triton_moe_int4.triton_moe_int4_ops() is triton_moe_int4
    monkeypatch.setenv("TOKENMILL_TRITON_MOE", "0")
    triton_moe.triton_moe_ops.cache_clear()
    try:
        assert triton_moe_int4.triton_moe_int4_ops() is None
    finally:
        monkeypatch.delenv("TOKENMILL_TRITON_MOE")
        triton_moe.triton_moe_ops.cache_clear()


# Compiles the kernel for sm_90 in a fresh process (no TRITON_INTERPRET), as test_triton_moe.py does: the launch
# shapes of blocks_for at decode, mid and long prefill, both launches, groups 32 and 128 (BLOCK_K 32 and 64), bf16
# and fp16 with bf16 scales, fp32 with fp32 scales (GGUF), and act-order once.
_COMPILE_SCRIPT = """
from engine.kernels import triton_moe_int4_kernels as K
from engine.kernels.triton_moe import blocks_for
from engine.kernels.triton_moe_int4 import int4_blocks

cases = [(dt, pairs, group, False) for dt in ("bf16", "fp16") for pairs in (8, 4096, 65536) for group in (32, 128)]
cases += [("fp32", 4096, 128, False), ("bf16", 8, 128, True)]
for dt, pairs, group, perm in cases:
    types = {p: "*" + dt for p in ("a_ptr", "c_ptr", "weights_ptr")}
    scale = "*fp32" if dt == "fp32" else "*bf16"
    types.update(qweight_ptr="*u8", scales_ptr=scale, zeros_ptr=scale, perm_ptr="*i64", sorted_pairs_ptr="*i64",
                 block_expert_ptr="*i64", padded_total_ptr="*i64")
    b = int4_blocks(blocks_for(pairs, 128), group)
    for div, mul in ((8, False), (1, True)):
        compile_kernel(K.grouped_gemm_int4_kernel, types, dict(GROUP_SIZE=group, A_ROW_DIV=div, MUL_WEIGHT=mul,
                       HAS_PERM=perm, IEEE=dt == "fp32", BF16_WORKAROUND=False, BLOCK_M=b.m, BLOCK_N=b.n,
                       BLOCK_K=b.k), num_warps=b.warps, num_stages=b.stages)
print("compiled")
"""


def test_kernel_compiles_for_sm90() -> None:
    compile_for_sm90("triton_moe_int4", _COMPILE_SCRIPT, {"num_warps": 4})
