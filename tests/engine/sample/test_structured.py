"""Structured outputs, logprobs, n samples and penalties on the real model and real prompts (engine/
structured_output.py, engine/sample/logits_processors.py): JSON Schema outputs validate, choices and regexes are
respected,
a bad schema is an error row while the others finish, a seeded constrained row survives preemption, n samples share
the prompt's KV blocks. (Logprobs against HF transformers' log_softmax: test_hf_parity.py, which loads HF once.)"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from squeezed_pool import roomy_and_squeezed

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"},
                                                  "unit": {"type": "string", "maxLength": 12}},
                 "required": ["answer", "unit"], "additionalProperties": False}


def _schema_params(max_tokens: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(
        json_schema=json.dumps(ANSWER_SCHEMA)), **kw)


def test_json_schema_outputs_validate_and_length_rows_are_flagged(engine: LLMEngine,
                                                                  gsm8k_questions: list[str]) -> None:
    prompts = [q + "\nReply with JSON: the integer answer and its unit." for q in gsm8k_questions[:4]]
    outs = engine.generate(prompts, _schema_params())
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, [o.text for o in outs]
    for o in stopped:
        assert o.valid is True
        jsonschema.validate(json.loads(o.text), ANSWER_SCHEMA)
        # One layout (README): json.dumps' separators, no other whitespace, so not the compact ',' / ':'.
        assert o.text == json.dumps(json.loads(o.text), ensure_ascii=False) and '": ' in o.text
    # Cut short by max_tokens: "length", and flagged not valid.
    short = engine.generate(prompts[:1], _schema_params(max_tokens=3))[0]
    assert short.finish_reason == "length" and short.valid is False
    assert short.text.startswith('{"')
    # Unconstrained rows say nothing about validity.
    assert engine.generate(prompts[:1], SamplingParams(max_tokens=2))[0].valid is None


def test_choices_and_regex_are_respected(engine: LLMEngine, alpaca_instructions: list[str]) -> None:
    choices = ("writing", "coding", "math", "science", "history", "travel", "food", "health", "business", "art",
               "sports", "other")
    prompts = [f"Which category fits this request best? {q}" for q in alpaca_instructions[:5]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choices=choices)))
    assert all(o.text in choices and o.finish_reason == "stop" and o.valid for o in outs), [o.text for o in outs]
    pattern = r"[A-Z][a-z]{2,8} (19|20)[0-9]{2}"
    regex = SamplingParams(max_tokens=12, temperature=0.9, seed=5,
                           structured_outputs=StructuredOutputsParams(regex=pattern))
    outs = engine.generate([f"Name a month and year for: {q}" for q in alpaca_instructions[5:8]], regex)
    assert all(re.fullmatch(pattern, o.text) and o.valid for o in outs), [o.text for o in outs]


def test_a_bad_schema_is_an_error_row_and_the_others_finish(engine: LLMEngine, gsm8k_questions: list[str]) -> None:
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        json_schema='{"type": "object", "properties": {"a": {"type": "integr"}}}'))
    obj = SamplingParams(max_tokens=24, structured_outputs=StructuredOutputsParams(json_object=True))
    outs = engine.generate(gsm8k_questions[:4], [_schema_params(8), bad, SamplingParams(max_tokens=4), obj])
    assert outs[1].finish_reason == "error" and "integr" in outs[1].error and "json_schema" in outs[1].error
    assert outs[0].finish_reason in ("stop", "length") and outs[0].text.startswith("{")
    assert outs[2].num_output_tokens == 4
    assert outs[3].text.startswith("{") and (outs[3].finish_reason == "length" or isinstance(json.loads(outs[3].text),
                                                                                           dict))
    # Compiled once per distinct constraint: the bad one again is refused from the cache.
    compiled = engine.structured_outputs.num_compiled
    assert engine.generate(gsm8k_questions[:1], bad)[0].finish_reason == "error"
    assert engine.structured_outputs.num_compiled == compiled
    assert not engine.logits_processors.active  # nothing left registered


def test_a_compiling_grammar_holds_back_only_its_rows(engine: LLMEngine, gsm8k_questions: list[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiles run in the background: while two constraints compile (held until an unconstrained row has
    finished), the unconstrained rows run and finish; then the good constraint's row runs valid, and the one whose
    compile fails late ends as an error row naming the problem."""
    import threading

    eng = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))
    manager = eng.structured_outputs
    released = threading.Event()
    compile_now = manager._compile_now

    def slow_compile(spec: StructuredOutputsParams) -> object:
        released.wait(120)  # bounded: a compile that blocked the plain rows fails the ordering asserts below
        return compile_now(spec)

    monkeypatch.setattr(manager, "_compile_now", slow_compile)
    plain = SamplingParams(max_tokens=3)
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9"))
    params = [plain, _schema_params(24), plain, bad]
    finished: list[str] = []

    def on_output(out: object) -> None:
        finished.append(out.request_id)
        released.set()

    outs = eng.generate(gsm8k_questions[60:64], params, on_output=on_output)
    assert set(finished[:2]) == {"0", "2"}, finished  # both plain rows finished before any constrained row
    assert outs[1].ttft_s > max(outs[0].latency_s, outs[2].latency_s)
    assert outs[1].finish_reason in ("stop", "length") and outs[1].text.startswith('{"answer"')
    assert outs[1].valid is (outs[1].finish_reason == "stop")
    assert outs[3].finish_reason == "error" and "regex" in outs[3].error and outs[3].output_token_ids == []
    assert not eng.logits_processors.active and eng.logits_processors._num_compiling == 0


def test_a_seeded_constrained_row_survives_preemption(engine: LLMEngine, gsm8k_questions: list[str]) -> None:
    prompts = gsm8k_questions[40:44]
    params = [_schema_params(10, temperature=1.0, top_p=0.95, seed=i) for i in range(4)]
    roomy, squeezed = roomy_and_squeezed(engine, prompts, params)
    assert [o.output_token_ids for o in squeezed] == [o.output_token_ids for o in roomy]
    assert [o.valid for o in squeezed] == [o.valid for o in roomy]


def test_n_samples_share_the_prompt_blocks_and_seeded_ones_repeat(engine: LLMEngine,
                                                                   alpaca_instructions: list[str]) -> None:
    fresh = engine.with_config(EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=256))
    prompt = alpaca_instructions[10]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=11, n=4)
    hits = fresh.kv_cache_manager.pool.num_cache_hits
    out = fresh.generate([prompt], params)[0]
    full_blocks = (out.num_prompt_tokens - 1) // 16
    assert full_blocks >= 2
    # The prompt's full blocks computed once: the 3 siblings take them from the prefix cache.
    assert fresh.kv_cache_manager.pool.num_cache_hits - hits >= 3 * full_blocks
    assert out.samples is not None and len(out.samples) == 4
    assert len({tuple(s.output_token_ids) for s in out.samples}) == 4
    assert out.text == out.samples[0].text and all(s.request_id == out.request_id for s in out.samples)
    again = engine.generate([prompt], params)[0]
    assert [s.output_token_ids for s in again.samples] == [s.output_token_ids for s in out.samples]
    # Sample j of seed s is the single request of seed s + j.
    alone = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.8, seed=13))[0]
    assert alone.output_token_ids == out.samples[2].output_token_ids


def test_the_engine_loop_keeps_constraints_logprobs_and_samples(engine: LLMEngine, alpaca_instructions: list[str],
                                                                gsm8k_questions: list[str]) -> None:
    # Shards submit through engine.loop.engine_loop (engine-wide request ids, two submitters at once): every row's
    # logits-processor state must follow it there, so the outputs equal a plain generate's.
    from engine.loop.engine_loop import EngineLoop

    choices = ("yes", "no", "maybe")
    constrained = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(choices=choices),
                                 logprobs=2)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=3)
    prompts_a, prompts_b = alpaca_instructions[:3], gsm8k_questions[:2]
    want_a = engine.generate(prompts_a, constrained)
    want_b = engine.generate(prompts_b, sampled)
    loop = EngineLoop(engine)
    try:
        sub_a = loop.submit(prompts_a, constrained)
        sub_b = loop.submit(prompts_b, sampled)
        got_a, got_b = sub_a.results(), sub_b.results()
    finally:
        loop.close(timeout_s=60)
    assert [o.text for o in got_a] == [o.text for o in want_a] and all(o.text in choices for o in got_a)
    assert [[t.token_id for t in o.logprobs] for o in got_a] == [[t.token_id for t in o.logprobs] for o in want_a]
    assert [o.request_id for o in got_b] == ["0", "1"]
    assert [[s.output_token_ids for s in o.samples] for o in got_b] == \
        [[s.output_token_ids for s in o.samples] for o in want_b]
    assert not engine.logits_processors.states  # nothing left behind for the next rows
