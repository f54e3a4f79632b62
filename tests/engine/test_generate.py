"""LLMEngine.generate on the real model and real prompts: sampling, stop conditions, bad prompts, chunked prefill."""

from __future__ import annotations

import pytest
from squeezed_pool import roomy_and_squeezed

from engine import EngineConfig, LLMEngine, SamplingParams


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: LLMEngine, alpaca_instructions: list[str]) -> None:
    prompts = alpaca_instructions[:6]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1000 + i) for i in range(6)]
    together = engine.generate(prompts, params)
    # Same requests, other batch composition and order.
    alone = engine.generate(prompts[3:][::-1], params[3:][::-1]) + engine.generate(prompts[:3], params[:3])
    by_prompt = {tuple(o.prompt_token_ids): o.output_token_ids for o in alone}
    assert [by_prompt[tuple(o.prompt_token_ids)] for o in together] == [o.output_token_ids for o in together]
    reseeded = engine.generate(prompts, [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i)
                                         for i in range(6)])
    assert [o.output_token_ids for o in reseeded] != [o.output_token_ids for o in together]
    # Sampling really samples: at temperature 0.9 it leaves the greedy path somewhere.
    greedy = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.output_token_ids for o in greedy] != [o.output_token_ids for o in together]


def test_seeded_sampling_survives_preemption(engine: LLMEngine, gsm8k_questions: list[str]) -> None:
    # A pool that holds the four prompts (112 blocks of 4) with 2 blocks to spare but not their 8 output tokens each:
    # requests are preempted mid-decode and recomputed; a seeded request's noise depends only on (seed, output
    # index), so it picks up its draws where it left them.
    prompts = gsm8k_questions[40:44]
    params = [SamplingParams(max_tokens=8, temperature=1.0, top_k=0 if i % 2 else 40, top_p=0.9, seed=i)
              for i in range(len(prompts))]
    roomy, squeezed = roomy_and_squeezed(engine, prompts, params)
    assert [o.output_token_ids for o in squeezed] == [o.output_token_ids for o in roomy]


def test_top_k_one_is_greedy(engine: LLMEngine, gsm8k_questions: list[str]) -> None:
    prompts = gsm8k_questions[:3]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=10))
    top1 = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=1.5, top_k=1))
    assert [o.output_token_ids for o in top1] == [o.output_token_ids for o in greedy]


def test_stop_conditions(engine: LLMEngine, gsm8k_questions: list[str]) -> None:
    prompt = gsm8k_questions[10]
    (base,) = engine.generate([prompt], SamplingParams(max_tokens=24))
    assert base.finish_reason == "length" and base.num_output_tokens == 24

    stop_text = base.text[len(base.text) // 2:][:6]
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=24, stop=[stop_text]))
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[:base.text.index(stop_text)]

    stop_id = base.output_token_ids[5]
    (tok,) = engine.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=[stop_id]))
    first = base.output_token_ids.index(stop_id)
    assert tok.finish_reason == "stop" and tok.output_token_ids == base.output_token_ids[:first + 1]


def test_eos_and_ignore_eos(engine: LLMEngine) -> None:
    prompt = "Answer with one word: what color is the sky on a clear day?"
    (short,) = engine.generate([prompt], SamplingParams(max_tokens=64))
    assert short.finish_reason == "stop" and short.output_token_ids[-1] == engine.eos_token_id
    (long,) = engine.generate([prompt], SamplingParams(max_tokens=short.num_output_tokens + 8, ignore_eos=True))
    assert long.finish_reason == "length" and long.num_output_tokens == short.num_output_tokens + 8


def test_bad_prompts_become_errors_and_the_rest_goes_on(engine: LLMEngine, gsm8k_questions: list[str]) -> None:
    too_long = " ".join(gsm8k_questions[:400])
    prompts = [gsm8k_questions[0], "", too_long, "   ", gsm8k_questions[1]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=4), request_ids=["a", "b", "c", "d", "e"])
    assert [o.request_id for o in outs] == ["a", "b", "c", "d", "e"]
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "empty" in outs[1].error and "tokens" in outs[2].error and "shorten" in outs[2].error
    assert outs[0].num_output_tokens == 4 and outs[4].num_output_tokens == 4


def test_chat_messages_equal_text_with_template(engine: LLMEngine, gsm8k_questions: list[str]) -> None:
    q = gsm8k_questions[5]
    (a,) = engine.generate([q], SamplingParams(max_tokens=8))
    (b,) = engine.generate([[{"role": "user", "content": q}]], SamplingParams(max_tokens=8))
    (raw,) = engine.generate([q], SamplingParams(max_tokens=8), use_chat_template=False)
    assert a.prompt_token_ids == b.prompt_token_ids and a.output_token_ids == b.output_token_ids
    assert raw.prompt_token_ids == engine.tokenizer.encode(q)


def test_chunked_prefill_gives_the_same_greedy_tokens(engine: LLMEngine, alpaca_instructions: list[str]) -> None:
    prompts = sorted(alpaca_instructions[:40], key=len)[-4:]  # the longest of the first 40
    whole = engine.generate(prompts, SamplingParams(max_tokens=12))
    chunked_engine = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=16))
    chunked = chunked_engine.generate(prompts, SamplingParams(max_tokens=12))
    assert all(o.num_prompt_tokens > 32 for o in whole)  # every prompt really was split into chunks
    assert [o.output_token_ids for o in chunked] == [o.output_token_ids for o in whole]


def test_prefix_caching_reuses_shared_blocks_and_keeps_outputs(engine: LLMEngine,
                                                                 gsm8k_questions: list[str]) -> None:
    # A batch job with a long shared system prompt: its full blocks are computed once and shared.
    system = ("You are a careful math tutor. Solve the problem step by step, show each intermediate result, "
              "and finish with a line of the form 'Answer: <number>'.")
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in gsm8k_questions[:6]]
    params = SamplingParams(max_tokens=10)
    # All six fit in one step: the first computes the shared blocks, the other five wait one step for them.
    cached = engine.with_config(EngineConfig(device="cpu", dtype="float32", enable_prefix_caching=True))
    plain = engine.with_config(EngineConfig(device="cpu", dtype="float32", enable_prefix_caching=False))
    with_cache = cached.generate(prompts, params)
    without = plain.generate(prompts, params)
    shared_blocks = 40 // cached.block_size  # the system prompt and template span > 40 tokens
    assert cached.kv_cache_manager.pool.num_cache_hits >= 5 * shared_blocks
    assert plain.kv_cache_manager.pool.num_cache_hits == 0
    assert [o.output_token_ids for o in with_cache] == [o.output_token_ids for o in without]
    cached.kv_cache_manager.check_integrity()
    # After reset_prefix_cache the first request of a rerun finds nothing cached (cold, as on a fresh engine).
    assert cached.reset_prefix_cache() > 0
    hits = cached.kv_cache_manager.pool.num_cache_hits
    cold = cached.generate(prompts[:1], params)
    assert cached.kv_cache_manager.pool.num_cache_hits == hits
    assert cold[0].output_token_ids == without[0].output_token_ids
    cached.kv_cache_manager.check_integrity()


def test_should_stop_aborts_unfinished_requests_and_frees_their_blocks(engine: LLMEngine,
                                                                       alpaca_instructions: list[str]) -> None:
    # A spot notice mid-batch: what finished is kept, the rest comes back as "abort" with no tokens. The stop comes
    # after 6 steps, when the 4-token rows are done and the 12-token rows are at most half way (one token a step).
    prompts = alpaca_instructions[20:28]
    params = [SamplingParams(max_tokens=4 if i % 2 == 0 else 12) for i in range(len(prompts))]
    small = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))
    finished: list[str] = []
    outs = small.generate(prompts, params, on_output=lambda o: finished.append(o.request_id),
                          should_stop=lambda: small.num_steps >= 6)
    by_reason = {r: [o.request_id for o in outs if o.finish_reason == r] for r in ("length", "abort")}
    assert [o.request_id for o in outs] == [str(i) for i in range(len(prompts))]
    assert sorted(by_reason["length"]) == sorted(finished) == [str(i) for i in range(0, len(prompts), 2)]
    assert sorted(by_reason["abort"]) == [str(i) for i in range(1, len(prompts), 2)]
    assert all(o.num_output_tokens == 0 and o.num_prompt_tokens > 0 for o in outs if o.finish_reason == "abort")
    assert small.kv_cache_manager.pool.num_free_blocks == small.num_kv_blocks
    small.kv_cache_manager.check_integrity()
    # The engine is reusable afterwards: the aborted requests run to the same tokens as an undisturbed run.
    again = small.generate(prompts[1::2], params[1::2])
    alone = engine.generate(prompts[1::2], params[1::2])
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in alone]


def test_a_failing_callback_propagates_and_leaves_the_engine_clean(engine: LLMEngine,
                                                                  alpaca_instructions: list[str]) -> None:
    # A checkpoint commit that fails inside on_output: the error reaches the caller, nothing stays queued or holds
    # KV blocks, and the long-lived engine serves the next shard as if nothing happened.
    prompts = alpaca_instructions[30:36]
    params = [SamplingParams(max_tokens=3 + 6 * (i % 2)) for i in range(len(prompts))]
    small = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=4))

    def fail(out: object) -> None:
        raise OSError("commit failed")

    with pytest.raises(OSError, match="commit failed"):
        small.generate(prompts, params, on_output=fail)
    assert not small.scheduler.has_unfinished
    assert small.kv_cache_manager.pool.num_free_blocks == small.num_kv_blocks
    small.kv_cache_manager.check_integrity()
    again = small.generate(prompts, params)
    alone = engine.generate(prompts, params)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in alone]


def test_text_of_a_cut_character_is_the_full_decode_and_stop_strings_can_be_any_text(
        engine: LLMEngine, alpaca_instructions: list[str]) -> None:
    # Real instructions with non-ASCII text draw non-ASCII answers, some with a character split between tokens.
    prompts = [t for t in alpaca_instructions if not t.isascii()][:8]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6))
    decode = engine.tokenizer.decode
    cuts = [(i, n) for i, o in enumerate(outs) for n in range(1, o.num_output_tokens)
            if decode(o.output_token_ids[:n]).endswith("\ufffd")]
    assert cuts, "no answer split a character between tokens; pick other prompts"
    for o in outs:
        assert o.text == decode(o.output_token_ids)
    i, n = cuts[0]
    (cut,) = engine.generate([prompts[i]], SamplingParams(max_tokens=n))
    assert cut.output_token_ids == outs[i].output_token_ids[:n] and cut.finish_reason == "length"
    # HF's choice (schemas/arrow.py, completion): the cut character is U+FFFD, as decode(ids) gives it
    assert cut.text == decode(cut.output_token_ids) and cut.text.endswith("\ufffd")
    # The character that was cut, as a stop string: found once its last byte arrives, and left out of the text.
    char = outs[i].text[len(cut.text.rstrip("\ufffd"))]
    (stopped,) = engine.generate([prompts[i]], SamplingParams(max_tokens=6, stop=[char]))
    assert stopped.finish_reason == "stop" and stopped.text == outs[i].text[:outs[i].text.index(char)]
    assert char in decode(stopped.output_token_ids) and char not in decode(stopped.output_token_ids[:-1])


def test_bfloat16_runs_on_every_cpu_kind(tiny_model: str, gsm8k_questions: list[str],
                                         caplog: pytest.LogCaptureFixture) -> None:
    # An explicit --dtype bfloat16 runs on CPUs without native bf16 too (AVX2-only: oneDNN cannot pack bf16 there,
    # so those linears stay plain), with a warning that float32 is faster there; where bf16 is native, no warning.
    from torch import nn

    from engine.quant.packed_linear import PackedLinear, can_pack
    from engine.worker import device
    from engine.worker.device import cpu_has_native_bf16

    device._warn_once.cache_clear()  # said once per process: an earlier test of this worker may have said it
    with caplog.at_level("WARNING"):
        bf16 = LLMEngine.from_model(tiny_model, EngineConfig(device="cpu", dtype="bfloat16", num_kv_blocks=64))
    assert ("runs emulated" in caplog.text) == (not cpu_has_native_bf16())
    lm_head = bf16.runner.model.lm_head
    assert isinstance(lm_head, PackedLinear) if can_pack(bf16.dtype) else type(lm_head) is nn.Linear
    outs = bf16.generate(gsm8k_questions[:4], SamplingParams(max_tokens=8))
    assert [o.finish_reason for o in outs] == ["length"] * 4 and all(o.num_output_tokens == 8 for o in outs)
    assert all(o.text for o in outs)
