"""The Triton grouped-GEMM MoE experts (engine.kernels.triton_moe) vs the per-expert torch path they replace on CUDA
(engine.layers.moe.GroupedExperts on the CPU), and on CUDA a MoE engine with them and CUDA graphs against the loop.

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors; TRITON_INTERPRET=1 is set at module
import, before triton decorates the kernel (as test_triton_fused.py does). Shapes stay tiny and odd (hidden and
intermediate sizes no multiple of any block), with small blocks so that the interpreter is quick and every expert
spans several blocks. The routing covers ties (equal router logits), an expert no token picks, and T = 1.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from triton_testing import compile_for_sm90, skip_without_a_backend  # noqa: E402

from engine.kernels import triton_moe  # noqa: E402
from engine.kernels.triton_moe import Blocks, align_pairs, fused_experts  # noqa: E402
from engine.layers.moe import GroupedExperts, grouped_gemm_ops, route  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
HIDDEN, INTER, EXPERTS, TOP_K = 24, 20, 6, 2
UNUSED = 4  # the expert no token is routed to
SMALL = Blocks(m=4, n=16, k=16, warps=1, stages=1) if INTERPRET else Blocks(m=16, n=16, k=16, warps=1, stages=1)
# (compiled tl.dot needs blocks of 16 or more)


@pytest.fixture(autouse=True)
def _needs_a_backend() -> None:
    skip_without_a_backend("engine.kernels.triton_moe_kernels", "grouped_gemm_kernel")


def _experts(dtype: torch.dtype) -> GroupedExperts:
    """Random experts (std 0.3, so SwiGLU outputs vary), fused gate/up, on DEVICE."""
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(EXPERTS, HIDDEN, INTER)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    experts.fuse()
    return experts.to(device=DEVICE, dtype=dtype).eval()


def _routing(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, HIDDEN], ids [T, k], weights [T, k]) from route() on random logits where expert UNUSED never wins and
    the first three tokens have ties: all logits equal, and two experts equal to the top one."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    logits = torch.randn(tokens, EXPERTS, generator=g)
    logits[:, UNUSED] = -30.0
    if tokens >= 3:
        logits[0] = 0.5
        logits[0, UNUSED] = -30.0
        logits[1, 1] = logits[1, 3] = logits[1].max() + 1.0
        logits[2, 0] = logits[2, 5] = logits[2, 2] = logits[2].max() + 0.25
    weights, ids = route(logits, TOP_K, "softmax_topk", True)
    return x.to(DEVICE), ids.to(DEVICE), weights.to(dtype).to(DEVICE)


def _torch_path(experts: GroupedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The per-expert loop of GroupedExperts (on the CPU: grouped_gemm_ops serves CUDA tensors only)."""
    with torch.no_grad():
        return experts.cpu()(x.cpu(), ids.cpu(), weights.cpu()).to(x.device)


def test_align_pairs_groups_by_expert_pads_each_run_and_skips_unused_experts() -> None:
    ids = torch.tensor([[0, 3], [3, 5], [0, 3], [1, 3], [3, 5]], device=DEVICE)  # expert 2 and 4: no rows
    sorted_pairs, block_expert, total = align_pairs(ids, EXPERTS, 4)
    pairs = ids.numel()
    assert sorted_pairs.numel() == 28  # the worst case: 10 pairs + min(6, 10) experts * 3 padding
    # expert 0: pairs 0, 4 (+2 pad); 1: pair 6 (+3); 3: pairs 1, 2, 5, 7, 8 (+3); 5: pairs 3, 9 (+2)
    want = [0, 4, pairs, pairs, 6, pairs, pairs, pairs, 1, 2, 5, 7, 8, pairs, pairs, pairs, 3, 9, pairs, pairs]
    assert sorted_pairs[:20].tolist() == want and (sorted_pairs[20:] == pairs).all()
    assert total.tolist() == [20]
    assert block_expert[:5].tolist() == [0, 1, 3, 3, 5]
    assert set(block_expert.tolist()) & {2, 4} == set()


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_fused_experts_equal_the_torch_path_in_fp32(tokens: int) -> None:
    experts = _experts(torch.float32)
    x, ids, weights = _routing(tokens, torch.float32)
    assert UNUSED not in ids.flatten().tolist() and (ids[:, 0] < ids[:, 1]).all()
    gate_up, down = experts.stacked()
    out = fused_experts(x, gate_up, down, ids, weights, SMALL)
    ref = _torch_path(experts, x, ids, weights)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.abs().max() > 0.1  # the experts did something


def test_fused_experts_default_blocks_and_bf16() -> None:
    """bf16 near the fp32 result of the same bf16 weights: within 2^-5 of its largest magnitude (measured: 0.021 under
    the interpreter, which rounds fp32 -> bf16 by truncation at each of the four roundings, where the GPU and torch
    round to nearest; the torch loop in bf16 is within 0.004). A wrong expert, a lost weight or a lost row is off by
    the output's own size."""
    experts = _experts(torch.bfloat16)
    x, ids, weights = _routing(9, torch.bfloat16)
    gate_up, down = experts.stacked()
    out = fused_experts(x, gate_up, down, ids, weights)
    assert out.dtype == torch.bfloat16
    truth = _torch_path(_experts(torch.bfloat16).float(), x.float(), ids, weights.float())
    torch.testing.assert_close(out.float(), truth, rtol=0.0, atol=2 ** -5 * truth.abs().max().item())


def test_fused_experts_name_what_they_cannot_serve() -> None:
    experts = _experts(torch.float32)
    x, ids, weights = _routing(3, torch.float32)
    gate_up, down = experts.stacked()
    with pytest.raises(ValueError, match="down dtype"):
        fused_experts(x, gate_up, down.half(), ids, weights)
    with pytest.raises(ValueError, match="do not fit hidden"):
        fused_experts(x, gate_up, down[:, :-1], ids, weights)
    with pytest.raises(ValueError, match="ids dtype"):
        fused_experts(x, gate_up, down, ids.int(), weights)


def test_grouped_gemm_ops_serve_cuda_activations_only() -> None:
    assert grouped_gemm_ops(torch.zeros(2, 4)) is None  # CPU: the per-expert loop with packed GEMMs
    if torch.cuda.is_available():
        with torch.no_grad():
            assert grouped_gemm_ops(torch.zeros(2, 4, device="cuda", dtype=torch.bfloat16)) is triton_moe
        assert grouped_gemm_ops(torch.zeros(2, 4, device="cuda")) is None  # autograd on


@pytest.mark.gpu
def test_moe_engine_greedy_is_token_identical_to_the_torch_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3-MoE shape (random weights, 8 experts, top-2) on CUDA in fp32: greedy output with the grouped
    GEMMs and CUDA graphs equals the per-expert torch loop's without graphs (TOKENMILL_TRITON_MOE=0), token for
    token."""
    import dataclasses

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loading.presets import preset_config

    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set: the engine on CUDA needs compiled kernels")
    cfg = dataclasses.replace(preset_config("tiny-smollm2"), architecture="qwen3_moe", qk_norm=True, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=48, router="softmax_topk",
                              norm_topk_prob=True)
    prompts = [[(7 * i + 3 * j) % 4000 + 10 for j in range(5 + 3 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs = {}
    try:
        for switch in ("0", "1"):
            monkeypatch.setenv("TOKENMILL_TRITON_MOE", switch)
            triton_moe.triton_moe_ops.cache_clear()
            eng = LLMEngine.from_config(cfg, EngineConfig(device="cuda", dtype="float32", max_num_seqs=16))
            outputs[switch] = [o.output_token_ids for o in eng.generate(prompts, params)]
            assert (eng.runner.graphs is not None) == (switch == "1")
            del eng
    finally:
        triton_moe.triton_moe_ops.cache_clear()
    assert outputs["1"] == outputs["0"]
    assert len({tuple(o) for o in outputs["1"]}) > 1


# Compiles the kernel for sm_90 in a fresh process (no TRITON_INTERPRET), as test_triton_fused.py does: the
# interpreter checks no types, constexpr use or tl.dot shapes, the compiler does. The launch shapes of blocks_for.
_COMPILE_SCRIPT = """
from engine.kernels import triton_moe_kernels as K
from engine.kernels.triton_moe import blocks_for

for dt in ("bf16", "fp32"):
    types = {p: "*" + dt for p in ("a_ptr", "b_ptr", "c_ptr", "weights_ptr")}
    types.update(sorted_pairs_ptr="*i64", block_expert_ptr="*i64", padded_total_ptr="*i64")
    for pairs in (8, 4096, 65536):
        b = blocks_for(pairs, 128)
        for div, mul in ((8, False), (1, True)):
            compile_kernel(K.grouped_gemm_kernel, types, dict(A_ROW_DIV=div, MUL_WEIGHT=mul, IEEE=dt == "fp32",
                           BF16_WORKAROUND=False,
                           BLOCK_M=b.m, BLOCK_N=b.n, BLOCK_K=b.k), num_warps=b.warps, num_stages=b.stages)
print("compiled")
"""


def test_kernel_compiles_for_sm90() -> None:
    compile_for_sm90("triton_moe", _COMPILE_SCRIPT, {"num_warps": 4})
