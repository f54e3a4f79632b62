"""Asynchronous scheduling (EngineConfig.async_scheduling, LLMEngine.step): step n + 1 is planned and launched before
step n's tokens reach the host. On the CPU the steps still run one after the other, but every part of the logic runs:
placeholders for the tokens on the device, their gather into the next step's input ids, the late stop checks, the
step too many of a request that stopped, preemption of a request whose token is pending. The outputs must be the
synchronous engine's, token for token, on the real model and real prompts."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine.worker.model_runner import ModelRunner


def _pair(engine: LLMEngine, **limits: object) -> tuple[LLMEngine, LLMEngine]:
    """(synchronous, asynchronous) engines sharing `engine`'s weights, with the same limits."""
    sync = engine.with_config(EngineConfig(device="cpu", dtype="float32", async_scheduling=False, **limits))
    overlap = engine.with_config(EngineConfig(device="cpu", dtype="float32", async_scheduling=True, **limits))
    return sync, overlap


def _tokens(outputs: list[RequestOutput]) -> list[tuple[list[int], str, str]]:
    return [(o.output_token_ids, o.finish_reason, o.text) for o in outputs]


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[asynchronous steps launched, of them while a logits processor was registered in the engine]."""
    calls = [0, 0]
    launch = ModelRunner.launch

    def counted(self: ModelRunner, *args: object, **kwargs: object) -> object:
        calls[0] += 1
        calls[1] += bool(self.logits_processors is not None and self.logits_processors.active)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "launch", counted)
    return calls


def test_auto_is_on_for_cuda_only(engine: LLMEngine) -> None:
    assert engine.with_config(EngineConfig(device="cpu", dtype="float32")).async_scheduling is False
    assert engine.with_config(EngineConfig(device="cpu", dtype="float32", async_scheduling=True)).async_scheduling


def test_the_tokens_are_the_synchronous_ones(engine: LLMEngine, gsm8k_questions: list[str],
                                              alpaca_instructions: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that stop at EOS, at a stop string, at max_tokens, seeded sampled rows and n > 1, with fewer slots than
    rows (so rows join while others finish) and a step budget that splits prompts into chunks."""
    launches = _count_launches(monkeypatch)
    prompts = gsm8k_questions[:6] + alpaca_instructions[:6]
    params = [SamplingParams(max_tokens=24 + 3 * i) for i in range(4)]
    params += [SamplingParams(max_tokens=40, stop=["\n", " the"]) for _ in range(2)]
    params += [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(3)]
    params += [SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=7, n=2)]
    params += [SamplingParams(max_tokens=64), SamplingParams(max_tokens=5, ignore_eos=True)]
    sync, overlap = _pair(engine, max_num_seqs=5, max_num_batched_tokens=64)
    expected = sync.generate(prompts, params)
    assert launches[0] == 0
    got = overlap.generate(prompts, params)
    assert launches[0] > 0 and overlap._launched is None and not overlap.scheduler.has_unfinished
    assert _tokens(got) == _tokens(expected)
    assert [[s.output_token_ids for s in o.samples] for o in got if o.samples] == \
        [[s.output_token_ids for s in o.samples] for o in expected if o.samples]
    assert {o.finish_reason for o in expected} == {"stop", "length"}
    # A stopped request runs one step too many at most, whose token is dropped: a few more steps, never fewer.
    assert sync.num_steps <= overlap.num_steps <= sync.num_steps + len(prompts) + 1
    # Rows that reach max_tokens are known to end before their last token is read: not scheduled again.
    assert all(len(o.output_token_ids) <= p.max_tokens for o, p in zip(got, params, strict=True))


def test_preemption_while_a_token_is_pending(engine: LLMEngine, alpaca_instructions: list[str]) -> None:
    """A pool too small for the batch: requests are preempted, some while their token is on the device, and
    recomputed with it; the tokens stay the synchronous engine's. Short instructions (35-51 tokens with the chat
    template): each recompute re-reads its prompt, and the preemptions do not depend on the prompts' length."""
    prompts = alpaca_instructions[40:46]
    params = [SamplingParams(max_tokens=10 + i, temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(6)]
    # Room for every prompt and 3 blocks (12 tokens) of their 60-odd output tokens: preemption every few steps.
    blocks = sum(-(-(len(engine.prompt_token_ids(p)) + 1) // 4) for p in prompts) + 3
    limits = dict(block_size=4, num_kv_blocks=blocks, max_num_seqs=6, enable_prefix_caching=False)
    sync, overlap = _pair(engine, **limits)
    expected = sync.generate(prompts, params)
    got = overlap.generate(prompts, params)
    assert overlap.scheduler.num_preemptions >= 1 and sync.scheduler.num_preemptions >= 1
    assert _tokens(got) == _tokens(expected)


def test_max_model_len_stops_rows_without_a_step_past_it(engine: LLMEngine, alpaca_instructions: list[str]) -> None:
    """Rows that end at max_model_len: the last placeholder marks them, so no step is planned past the limit
    (which has no slot in the block table)."""
    prompts = alpaca_instructions[21:25]
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    longest = max(len(engine.prompt_token_ids(p)) for p in prompts)
    # A whole number of blocks: a step past the limit would need a block-table column the engine does not have.
    sync, overlap = _pair(engine, max_model_len=-(-longest // 4) * 4 + 8, block_size=4)
    expected = sync.generate(prompts, params)
    got = overlap.generate(prompts, params)
    assert {o.finish_reason for o in got} == {"length"}
    assert _tokens(got) == _tokens(expected)
    # Every end here is a length limit, known before the last token is read: not one step more than synchronous.
    assert overlap.num_steps == sync.num_steps


def test_logits_processors_fall_back_to_synchronous_steps(engine: LLMEngine, alpaca_instructions: list[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A row that asks for logprobs (a logits processor: it reads every step's token on the host) in a job of plain
    rows: the steps that run it are synchronous, the steps before it joins and after it ends asynchronous (it is
    registered, and waits, from the start), and nothing changes."""
    launches = _count_launches(monkeypatch)
    executes = [0]
    execute = ModelRunner.execute

    def counted(self: ModelRunner, *args: object, **kwargs: object) -> object:
        executes[0] += 1
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute", counted)
    prompts = alpaca_instructions[10:16]
    # Longest first: the logprobs row (the shortest) joins last, when a slot frees.
    params = [SamplingParams(max_tokens=16 + i, ignore_eos=True) for i in range(5)]
    params.append(SamplingParams(max_tokens=6, logprobs=2))
    sync, overlap = _pair(engine, max_num_seqs=3)
    expected = sync.generate(prompts, params)
    executes[0] = 0
    got = overlap.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    assert got[-1].logprobs is not None and [lp.token_id for lp in got[-1].logprobs] == \
        [lp.token_id for lp in expected[-1].logprobs]
    assert launches[1] > 0 and executes[0] > 0  # asynchronous steps while the logprobs row waited


def test_a_stop_notice_mid_run_leaves_the_engine_clean(engine: LLMEngine, alpaca_instructions: list[str]) -> None:
    """should_stop aborts with a step in flight: every row comes back "abort", and the next generate on the same
    engine gives the synchronous tokens (no placeholder or pending step left behind)."""
    prompts = alpaca_instructions[20:24]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    sync, overlap = _pair(engine)
    polls = [0]

    def stop_after_some_steps() -> bool:
        polls[0] += 1
        return polls[0] > 5

    aborted = overlap.generate(prompts, params, should_stop=stop_after_some_steps)
    assert [o.finish_reason for o in aborted] == ["abort"] * len(prompts)
    assert overlap._launched is None and not overlap.scheduler.has_unfinished
    assert _tokens(overlap.generate(prompts, params)) == _tokens(sync.generate(prompts, params))
