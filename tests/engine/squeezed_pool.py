"""Run the same requests twice: on the engine as it is, and on a copy whose KV pool is too small to hold them all,
so the scheduler must preempt and recompute (the tests of seeded and constrained rows surviving preemption)."""

from __future__ import annotations

from engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams


def roomy_and_squeezed(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]
                       ) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """(outputs on `engine`, outputs on a copy with 114 KV blocks of 4 tokens, max_num_seqs 4 and no prefix cache),
    after checking that the squeezed run did preempt some of them."""
    roomy = engine.generate(prompts, params)
    tight = engine.with_config(EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=114,
                                            max_num_seqs=4, enable_prefix_caching=False))
    squeezed = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions >= 1 and any(o.num_preemptions for o in squeezed)
    return roomy, squeezed
