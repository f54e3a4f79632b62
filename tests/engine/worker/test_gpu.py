"""The engine on a CUDA device (skipped without one): Triton kernels + CUDA graphs against the CPU reference path.

Run on a GPU box with `python -m pytest -q tests/engine/worker/test_gpu.py`.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model.perplexity import next_token_logits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_fp32(gguf_path: str) -> LLMEngine:
    return LLMEngine.from_model(gguf_path, EngineConfig(device="cuda", dtype="float32", max_num_seqs=32))


def _bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers near x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def test_gpu_fp32_greedy_equals_the_cpu_reference(engine: LLMEngine, gpu_fp32: LLMEngine,
                                                  gsm8k_questions: list[str]) -> None:
    assert gpu_fp32.runner.attn_fn.__name__ == "paged_attention_triton"
    assert gpu_fp32.runner.graphs is not None
    prompts = gsm8k_questions[:16]
    params = SamplingParams(max_tokens=32)
    cpu = engine.generate(prompts, params)
    gpu = gpu_fp32.generate(prompts, params)
    assert gpu_fp32.runner.graphs.graphs, "decode steps never replayed a CUDA graph"
    assert [o.output_token_ids for o in gpu] == [o.output_token_ids for o in cpu]


def test_gpu_bf16_differs_from_fp32_only_at_ties(engine: LLMEngine, gguf_path: str,
                                                 gsm8k_questions: list[str]) -> None:
    bf16 = LLMEngine.from_model(gguf_path, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=32))
    prompts = gsm8k_questions[:16]
    params = SamplingParams(max_tokens=32)
    cpu = engine.generate(prompts, params)
    gpu = bf16.generate(prompts, params)
    same = 0
    for c, g in zip(cpu, gpu, strict=True):
        if c.output_token_ids == g.output_token_ids:
            same += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(c.output_token_ids, g.output_token_ids, strict=False)) if a != b)
        logits = next_token_logits(engine.runner.model, c.prompt_token_ids + c.output_token_ids[:i])
        a, b = logits[c.output_token_ids[i]].item(), logits[g.output_token_ids[i]].item()
        # A tie: the fp32 logits of the two tokens are closer than bf16 can tell apart.
        assert abs(a - b) <= 2 * _bf16_ulp(max(abs(a), abs(b))), (i, a, b)
    assert same >= len(prompts) // 2


def test_cuda_graphs_equal_eager(gguf_path: str, gsm8k_questions: list[str]) -> None:
    # fp32: a graph replays its batch padded to the captured size, so cuBLAS may pick another GEMM kernel than eager's
    # unpadded batch; in bf16 that flipped a near-tie token on an H100 (2026-11-25), in fp32 the rounding gap is
    # far below any logit gap of these prompts.
    prompts = gsm8k_questions[16:40]
    params = SamplingParams(max_tokens=24)
    graphed = LLMEngine.from_model(gguf_path, EngineConfig(device="cuda", dtype="float32", max_num_seqs=16))
    eager = graphed.with_config(EngineConfig(device="cuda", dtype="float32", max_num_seqs=16, enforce_eager=True))
    assert eager.runner.graphs is None
    a = graphed.generate(prompts, params)
    b = eager.generate(prompts, params)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.graphs
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]


def test_kv_pool_overflow_completes_through_preemption(gpu_fp32: LLMEngine, gsm8k_questions: list[str]) -> None:
    prompts = gsm8k_questions[40:72]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    roomy = gpu_fp32.generate(prompts, params)
    tight = gpu_fp32.with_config(EngineConfig(device="cuda", dtype="float32", num_kv_blocks=96, max_num_seqs=32))
    pressured = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions >= 1
    assert [o.output_token_ids for o in pressured] == [o.output_token_ids for o in roomy]
    tight.kv_cache_manager.check_integrity()


def test_memory_stays_within_gpu_memory_utilization(gguf_path: str, gsm8k_questions: list[str]) -> None:
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    util = (total - free0) / total + 0.2  # whatever else holds memory now, plus 20% of the GPU for this engine
    eng = LLMEngine.from_model(gguf_path, EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=util))
    eng.generate(gsm8k_questions[:64], SamplingParams(max_tokens=32))
    free, _ = torch.cuda.mem_get_info()
    assert total - free <= util * total * 1.01


def test_grammar_bitmask_is_applied_on_the_device(engine: LLMEngine, gpu_fp32: LLMEngine, gsm8k_questions: list[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Constrained rows on CUDA: the bitmask is built on the host (pinned), copied once per step and applied to the
    logits on the device by xgrammar's Triton kernel; the outputs equal the CPU reference's (greedy, fp32)."""
    import json

    import xgrammar as xgr

    from engine import StructuredOutputsParams

    calls: list[tuple[str, str, str]] = []
    apply = xgr.apply_token_bitmask_inplace

    def spy(logits: torch.Tensor, bitmask: torch.Tensor, **kw: object) -> None:
        calls.append((logits.device.type, bitmask.device.type, str(kw.get("backend"))))
        apply(logits, bitmask, **kw)

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", spy)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    params = [SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(json_schema=json.dumps(schema)))
              if i % 2 else SamplingParams(max_tokens=24) for i in range(8)]
    gpu = gpu_fp32.generate(gsm8k_questions[:8], params)
    assert calls and set(calls) == {("cuda", "cuda", "triton")}
    assert gpu_fp32.logits_processors._bitmask.is_pinned()
    cpu = engine.generate(gsm8k_questions[:8], params)
    assert [o.output_token_ids for o in gpu] == [o.output_token_ids for o in cpu]
    assert all(json.loads(o.text)["answer"] is not None for o in gpu[1::2] if o.finish_reason == "stop")
