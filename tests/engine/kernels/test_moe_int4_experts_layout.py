"""The stacked INT4 experts the loaders build (engine.quant.experts: quantized on load by the handler, a GGUF file's
Q4_0 ffn_*_exps mapped as stored) are what the grouped W4A16 kernel takes: engine.kernels.triton_moe_int4.
fused_experts_int4 on GroupedExperts.int4_experts() gives the per-expert Int4Linear loop's output (issue 43).

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 set at module
import, as test_triton_moe_int4.py does); tiny shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
gguf = pytest.importorskip("gguf")

from triton_testing import skip_without_a_backend  # noqa: E402

from engine.kernels.triton_moe import Blocks  # noqa: E402
from engine.kernels.triton_moe_int4 import fused_experts_int4  # noqa: E402
from engine.layers.moe import GroupedExperts, route  # noqa: E402
from engine.loading.gguf_int4 import gguf_q4_to_int4  # noqa: E402
from engine.quant.experts import set_int4_experts  # noqa: E402
from engine.quant.handler import Int4QuantHandler  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
EXPERTS, HIDDEN, INTER, TOP_K = 4, 64, 32, 2


@pytest.mark.parametrize("source", ["int4 on load", "gguf Q4_0"])
def test_loaded_int4_experts_run_on_the_grouped_kernel(source: str) -> None:
    skip_without_a_backend("engine.kernels.triton_moe_int4_kernels", "grouped_gemm_int4_kernel")
    gen = torch.Generator().manual_seed(4)
    plain = {p: torch.randn(shape, generator=gen) * 0.3 for p, shape in (
        ("gate_proj", (EXPERTS, INTER, HIDDEN)), ("up_proj", (EXPERTS, INTER, HIDDEN)),
        ("down_proj", (EXPERTS, HIDDEN, INTER)))}
    if source == "gguf Q4_0":
        parts = {p: gguf_q4_to_int4(gguf.quants.quantize(w.reshape(-1, w.shape[-1]).numpy(),
                                                         gguf.GGMLQuantizationType.Q4_0), "Q4_0", tuple(w.shape))
                 for p, w in plain.items()}
    else:
        state = Int4QuantHandler(32).quantize_state_dict({f"experts.{p}.weight": w for p, w in plain.items()})
        parts = {p: state[f"experts.{p}"] for p in plain}
    model = torch.nn.Module()
    model.experts = GroupedExperts(EXPERTS, HIDDEN, INTER)
    for p in plain:
        setattr(model.experts, p, None)  # as engine.quant.experts.pop_int4_experts leaves a meta-device block
    set_int4_experts(model, {"experts": (parts, {})}, torch.float32, DEVICE)
    gate_up, down = model.experts.int4_experts()
    assert tuple(gate_up.qweight.shape) == (EXPERTS, 2 * INTER, HIDDEN // 2) and down.num_experts == EXPERTS
    x = torch.randn(10, HIDDEN, generator=gen).to(DEVICE)
    weights, ids = route(torch.randn(10, EXPERTS, generator=gen).to(DEVICE), TOP_K, "softmax_topk", True)
    with torch.no_grad():
        loop = model.experts(x, ids, weights)
        grouped = fused_experts_int4(x, gate_up, down, ids, weights, Blocks(m=4, n=16, k=16, warps=1, stages=1))
    torch.testing.assert_close(grouped, loop, rtol=1e-4, atol=1e-4)
