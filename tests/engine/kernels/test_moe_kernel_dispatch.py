"""GroupedExperts.forward's dispatch to the Triton grouped kernels (engine.layers.moe.GroupedExperts.grouped_kernels,
issues 43/44): INT4 experts held as stacks alone (GroupedExperts.set_int4, as engine.quant.experts builds them on CUDA
with Triton) run engine.kernels.triton_moe_int4.fused_experts_int4 and give the per-expert Int4Linear loop's output,
biased experts with gpt-oss's clamped SwiGLU too (plain and INT4); with autograd on the stacks alone fall back to a
loop over each expert's dequantized weights; experts_capturable follows which blocks the kernels serve, and the
loader's choice (engine.quant.experts.grouped_int4_experts) and the memory count's
(engine.worker.memory_fit.grouped_int4_experts_expected) follow Triton and TOKENMILL_TRITON_MOE.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 set at module
import, as test_triton_moe.py does) and forward's CUDA check (moe.grouped_kernels_serve) is patched to take them.
Tiny shapes; the kernels' default launch shapes (what forward uses).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from torch import nn  # noqa: E402
from triton_testing import skip_without_a_backend  # noqa: E402

from engine.kernels import triton_moe, triton_moe_int4  # noqa: E402
from engine.layers import moe  # noqa: E402
from engine.layers.moe import GroupedExperts, experts_capturable, route  # noqa: E402
from engine.quant.experts import expert_modules, grouped_int4_experts  # noqa: E402
from engine.quant.qparams import quantize_int4  # noqa: E402
from engine.quant.stacked_int4 import StackedInt4  # noqa: E402
from engine.worker.memory_fit import grouped_int4_experts_expected, weight_bytes  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
EXPERTS, HIDDEN, INTER, TOP_K, GROUP, TOKENS = 4, 64, 32, 2, 32, 7
LIMIT = 0.5  # gpt-oss's clamp, small enough to bite on these activations


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the grouped kernels forward calls, in order; under the interpreter, forward's CUDA check
    accepts CPU tensors (autograd still off)."""
    skip_without_a_backend("engine.kernels.triton_moe_int4_kernels", "grouped_gemm_int4_kernel")
    if INTERPRET:
        monkeypatch.setattr(moe, "grouped_kernels_serve", lambda x: not torch.is_grad_enabled())
    calls: list[str] = []
    for module, name in ((triton_moe, "fused_experts"), (triton_moe_int4, "fused_experts_int4")):
        def spy(*args: object, _run=getattr(module, name), _name=name, **kwargs: object) -> torch.Tensor:
            calls.append(_name)
            return _run(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def _stacks(seed: int) -> tuple[StackedInt4, StackedInt4, tuple[torch.Tensor, torch.Tensor]]:
    """Random INT4 experts (gate_up [E, 2I, hidden], down [E, hidden, I]; bf16 scales as the handler stores them)
    and random biases (gate_up [E, 2I], down [E, hidden]), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    stacks = [StackedInt4.from_weights([quantize_int4(torch.randn(out_f, in_f, generator=g) * 0.3, GROUP)
                                        for _ in range(EXPERTS)]).to(DEVICE)
              for out_f, in_f in ((2 * INTER, HIDDEN), (HIDDEN, INTER))]
    biases = (torch.randn(EXPERTS, 2 * INTER, generator=g).to(DEVICE),
              torch.randn(EXPERTS, HIDDEN, generator=g).to(DEVICE))
    return stacks[0], stacks[1], biases


def _routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, hidden], ids [T, k], weights [T, k]) on DEVICE, fp32; expert 3 takes no token."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, EXPERTS, generator=g)
    logits[:, 3] = -30.0
    weights, ids = route(logits, TOP_K, "softmax_topk", True)
    return torch.randn(TOKENS, HIDDEN, generator=g).to(DEVICE), ids.to(DEVICE), weights.to(DEVICE)


def _block(biased: bool) -> GroupedExperts:
    return GroupedExperts(EXPERTS, HIDDEN, INTER, bias=biased, swiglu_limit=LIMIT if biased else None)


@pytest.mark.parametrize("biased", [False, True], ids=["swiglu", "gpt-oss biases and clamp"])
def test_int4_stacks_alone_run_the_grouped_kernel_as_the_loop(kernel_calls: list[str], biased: bool) -> None:
    gate_up, down, biases = _stacks(1)
    biases = biases if biased else None
    loop = _block(biased)  # each expert's Int4Linear in the per-expert loop: fp32 dequantize-then-GEMM ("single"; on
    # CUDA "dual" would run tinygemm, whose activations are bf16)
    loop.set_gemms(*(expert_modules(w, torch.float32, DEVICE, "single") for w in (gate_up, down)), biases=biases)
    grouped = _block(biased)
    grouped.set_int4(gate_up, down, biases=biases)
    assert grouped.gemms is None and grouped.int4_experts() == (gate_up, down)
    x, ids, weights = _routing(2)
    with torch.no_grad():
        want = loop(x, ids, weights)
        assert kernel_calls == []  # per-expert modules: the loop
        got = grouped(x, ids, weights)
    assert kernel_calls == ["fused_experts_int4"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert want.abs().max() > 0.5
    with torch.enable_grad():  # the kernel serves no autograd: each expert's stacks dequantized in the loop
        fallback = grouped(x, ids, weights)
    assert kernel_calls == ["fused_experts_int4"]
    torch.testing.assert_close(fallback, want, rtol=1e-5, atol=1e-5)


def test_biased_clamped_plain_experts_run_the_grouped_kernel_as_the_loop(kernel_calls: list[str]) -> None:
    """gpt-oss's plain stacked experts: the dense grouped kernel with each row's biases and the clamped SwiGLU."""
    block = _block(True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    block = block.to(DEVICE)
    x, ids, weights = _routing(4)
    with torch.enable_grad():
        want = block(x, ids, weights).detach()
    with torch.no_grad():
        got = block(x, ids, weights)
    assert kernel_calls == ["fused_experts"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cuda_graphs_follow_the_blocks_the_kernels_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up, down, _ = _stacks(5)
    model = nn.Module()
    model.grouped = _block(False)
    model.grouped.set_int4(gate_up, down)
    assert experts_capturable(torch.bfloat16, model) and experts_capturable(torch.float32, model)
    assert not experts_capturable(torch.int8, model)
    model.loop = _block(False)  # INT4 gate/up, plain down: per-expert modules
    plain = down.dequantize()
    model.loop.set_gemms(expert_modules(gate_up, torch.float32, DEVICE), expert_modules(plain, torch.float32, DEVICE),
                         int4=(gate_up, None))
    assert not experts_capturable(torch.bfloat16, model)
    assert grouped_int4_experts(gate_up, down, torch.bfloat16, torch.device("cuda"))
    assert not grouped_int4_experts(gate_up, plain, torch.bfloat16, torch.device("cuda"))
    assert not grouped_int4_experts(gate_up, down, torch.bfloat16, torch.device("cpu"))
    assert grouped_int4_experts_expected("cuda") and not grouped_int4_experts_expected("cpu")
    monkeypatch.setenv("TOKENMILL_TRITON_MOE", "0")
    triton_moe.triton_moe_ops.cache_clear()
    try:
        assert not grouped_int4_experts(gate_up, down, torch.bfloat16, torch.device("cuda"))
        assert not grouped_int4_experts_expected("cuda")
        assert not experts_capturable(torch.bfloat16, nn.Sequential(model.grouped))
    finally:
        monkeypatch.undo()
        triton_moe.triton_moe_ops.cache_clear()


def test_grouped_int4_experts_are_counted_once() -> None:
    """On CUDA the grouped kernel's stacks are one copy (scales and zeros as stored) whatever the INT4 layout; the
    per-expert modules' are the layout's copies, as every INT4 weight's."""
    n, group = 8 * 96 * 64, 32
    held = [(n, group, True, 4), (1000, None)]
    one = n // 2 + n // group * 2 * 4
    for layout in ("dual", "single"):
        assert weight_bytes(held, "bfloat16", "cuda", layout, grouped_experts=True) == one + 2000
    assert weight_bytes(held, "bfloat16", "cuda", "dual", grouped_experts=False) == 2 * (n // 2 + n // group * 4) + 2000
    assert weight_bytes(held, "bfloat16", "cpu", grouped_experts=True) == n // 2 + n // group * 4 + 2000


def test_quantize_experts_keeps_biases_and_quantizes_expert_by_expert() -> None:
    """engine.quant.experts.quantize_experts (what quantize_model does to a MoE model's experts): the numbers
    quantize_int4 gives each expert, biases kept; on the CPU each expert's Int4Linear serves the loop."""
    from engine.quant.experts import quantize_experts

    model = nn.Module()
    model.experts = _block(True)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in model.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    plain = {n: p.detach().clone() for n, p in model.experts.named_parameters()}
    assert quantize_experts(model, GROUP) == 1 and model.experts.gemms is not None
    gate_up, down = model.experts.int4_experts()
    want = StackedInt4.from_weights([quantize_int4(w, GROUP) for w in plain["down_proj.weight"]])
    assert all(torch.equal(getattr(down, f), getattr(want, f)) for f in ("qweight", "scales", "zeros"))
    torch.testing.assert_close(gate_up.dequantize(), torch.cat([plain["gate_proj.weight"], plain["up_proj.weight"]],
                                                                1), atol=0.1, rtol=0)
    biases = model.experts.packed_biases
    assert torch.equal(biases[0], torch.cat([plain["gate_proj.bias"], plain["up_proj.bias"]], 1))
    assert torch.equal(biases[1], plain["down_proj.bias"])
