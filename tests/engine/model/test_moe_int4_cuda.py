"""INT4 mixture-of-experts experts on CUDA (issues 43/44; engine.quant.experts, engine.layers.moe): with Triton the
experts are held once, as the stacked INT4 weights (no per-expert module), and run on the grouped W4A16 kernel
(engine.kernels.triton_moe_int4) in CUDA graphs; greedy tokens on real prompts equal HF transformers' on the
dequantized weights (teacher-forced), with CUDA graphs and without. gpt-oss's biased experts with the clamped SwiGLU
run on the kernel too and give the per-expert loop's tokens. Without Triton (TOKENMILL_TRITON_MOE=0) the per-expert
Int4Linear loop runs, without CUDA graphs, in both INT4 layouts, and the kernel's bf16 output follows it.

The models: tests/engine/moe_models.py's tiny Qwen3-MoE (tied embeddings) and tests/engine/gpt_oss_models.py's tiny
gpt-oss; fp32 (the kernel's fp32 dot products are full IEEE, not TF32), bf16 where said. Every test needs CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from family_models import assert_hf_greedy
from llama_family_models import MAX_TOKENS
from moe_models import hf_holding
from moe_quant_models import loaded_weights

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import triton_moe
from engine.layers.moe import route
from engine.loading.open_model import open_model
from engine.quant.experts import quantize_experts

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")
pytest.importorskip("gguf")

CUDA = torch.device("cuda")
GROUP = 32


@contextlib.contextmanager
def triton_moe_switch(monkeypatch: pytest.MonkeyPatch, on: bool) -> Iterator[None]:
    """TOKENMILL_TRITON_MOE on or off within the block (triton_moe_ops reads it once per process: cleared here)."""
    with monkeypatch.context() as m:
        m.setenv("TOKENMILL_TRITON_MOE", "1" if on else "0")
        triton_moe.triton_moe_ops.cache_clear()
        try:
            yield
        finally:
            triton_moe.triton_moe_ops.cache_clear()
    triton_moe.triton_moe_ops.cache_clear()


def _engine(model: torch.nn.Module, cfg: object, dtype: torch.dtype, **config: object) -> LLMEngine:
    name = str(dtype).removeprefix("torch.")
    return LLMEngine(model, cfg, None, EngineConfig(device="cuda", dtype=name, num_kv_blocks=256, max_num_seqs=8,
                                                    **config), "moe", CUDA, dtype)


def _greedy(engine: LLMEngine, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def _int4_experts(folder: object, dtype: torch.dtype, layout: str = "dual") -> object:
    """The model of `folder` on CUDA in `dtype` with its experts alone INT4 (engine.quant.experts.quantize_experts,
    as the loader serves them): the dense layers stay plain, so that HF on the dequantized weights is the same
    function (an fp32 Int4Linear on CUDA runs tinygemm, whose activations are bf16, below 64 rows)."""
    loaded = open_model(str(folder), dtype, CUDA, quantization="none")
    assert quantize_experts(loaded.model, GROUP, layout) == loaded.config.num_layers
    return loaded


def test_int4_moe_on_the_grouped_kernel_matches_hf_with_and_without_cuda_graphs(moe_tied, moe_prompt_ids) -> None:
    model, folder, _ = moe_tied["qwen3_moe"]
    full = open_model(str(folder), torch.float32, CUDA, quantization="int4", group_size=GROUP).model.layers[0]
    assert full.mlp.experts.gemms is None and full.mlp.experts.int4_experts()[0].qweight.is_cuda  # no modules
    loaded = _int4_experts(folder, torch.float32)
    experts = loaded.model.layers[0].mlp.experts
    gate_up, down = experts.int4_experts()
    assert experts.gemms is None and gate_up.qweight.is_cuda and down.scales.is_cuda  # one copy: no modules
    weights = loaded_weights(loaded.model)
    graphs = _engine(loaded.model, loaded.config, torch.float32)
    assert graphs.runner.graphs is not None  # experts_capturable: the kernel syncs nothing on the host
    ours = _greedy(graphs, moe_prompt_ids)
    assert len({t for r in ours for t in r}) > 30, "degenerate random model"
    eager = _engine(loaded.model, loaded.config, torch.float32, enforce_eager=True)
    assert eager.runner.graphs is None and _greedy(eager, moe_prompt_ids) == ours
    assert_hf_greedy(hf_holding(model, {k: v.cpu() for k, v in weights.items()}), moe_prompt_ids, ours)


def test_gpt_oss_int4_experts_with_biases_and_clamp_on_the_grouped_kernel(tmp_path, hf_tok, moe_prompt_ids) -> None:
    """The kernel adds each row's expert biases and runs the clamped SwiGLU between its launches: a block's output
    equals the loop over its experts' dequantized weights (autograd on: the kernel serves none), and the engine
    generates with it (torch attention: gpt-oss's sinks)."""
    from gpt_oss_models import build_gpt_oss

    folder = tmp_path / "gpt_oss"
    build_gpt_oss(len(hf_tok), swiglu_limit=2.0, seed=43).save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    engine = LLMEngine.from_model(str(folder), EngineConfig(
        device="cuda", dtype="float32", quantization="int4", int4_group_size=GROUP, attention_backend="torch",
        num_kv_blocks=256, max_num_seqs=8))
    experts = engine.runner.model.layers[0].mlp.experts
    assert experts.gemms is None and experts.packed_biases is not None and experts.swiglu_limit == 2.0
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(24, experts.hidden_size, generator=gen).to(CUDA)
    weights, ids = route(torch.randn(24, experts.num_experts, generator=gen).to(CUDA), 2, "topk_softmax", True)
    with torch.no_grad():
        got = experts(x, ids, weights)
    with torch.enable_grad():
        want = experts(x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tokens = _greedy(engine, moe_prompt_ids[:4])
    assert len({t for r in tokens for t in r}) > 20, "degenerate random model"


def test_int4_experts_without_triton_run_the_per_expert_loop(moe_tied, moe_prompt_ids,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENMILL_TRITON_MOE=0: each expert's Int4Linear in the loop, no CUDA graphs: in fp32 under layout "single"
    (dequantize over views of the stacked weights) greedy tokens are HF's on the dequantized weights; in bf16 "dual"
    serves small row counts by tinygemm, "single" by the dequantize path. Both, and the grouped kernel's bf16 block,
    agree with the fp32 block within bf16 rounding. The dense layers stay plain (_int4_experts)."""
    model, folder, _ = moe_tied["qwen3_moe"]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 64, generator=gen).to(CUDA)
    weights, ids = route(torch.randn(24, 8, generator=gen).to(CUDA), 2, "softmax_topk", True)
    block_out = {}
    for dtype, layout in ((torch.float32, "single"), (torch.bfloat16, "dual"), (torch.bfloat16, "single"),
                          (torch.bfloat16, "kernel")):
        with triton_moe_switch(monkeypatch, layout == "kernel"):
            loaded = _int4_experts(folder, dtype, "dual" if layout == "kernel" else layout)
            held = loaded_weights(loaded.model)
            engine = _engine(loaded.model, loaded.config, dtype)
            experts = engine.runner.model.layers[0].mlp.experts
            gate_up, down = experts.int4_experts()
            assert gate_up.qweight.is_cuda and down.qweight.shape[0] == 8
            assert (engine.runner.graphs is None) == (layout != "kernel")
            if layout != "kernel":
                assert experts.gemms[0][0].kernel_for(1) == ("tinygemm" if layout == "dual" else "dequant")
            ours = _greedy(engine, moe_prompt_ids)
            with torch.no_grad():
                block_out[(dtype, layout)] = experts(x.to(dtype), ids, weights.to(dtype)).float()
        if dtype == torch.float32:
            assert_hf_greedy(hf_holding(model, {k: v.cpu() for k, v in held.items()}), moe_prompt_ids, ours)
    for layout in ("dual", "single", "kernel"):
        cos = torch.nn.functional.cosine_similarity(block_out[(torch.bfloat16, layout)],
                                                    block_out[(torch.float32, "single")], dim=-1)
        assert cos.min().item() > 0.999, layout
