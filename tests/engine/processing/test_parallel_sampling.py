"""A prompt's n > 1 samples as one parent request (engine.processing.parallel_sampling): the children's engine ids
never collide with the batch's other ids and are never parsed back, so a caller's id of any text (a "\\x1f" in it
too) comes back as it was given, through LLMEngine.generate and the engine loop alike."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine.loop.engine_loop import EngineLoop
from engine.processing.parallel_sampling import CHILD_SEP, ParentRequest, child_ids, child_params

# Ids that the old "<id>\x1f<j>" child ids would have confused: a prompt's samples named as another prompt.
IDS = ["a", f"a{CHILD_SEP}0", f"a{CHILD_SEP}1", f"row 7: {CHILD_SEP}\n\u00e9", ""]
NS = [2, 1, 3, 2, 2]


@pytest.fixture(scope="module")
def tiny_engine() -> LLMEngine:
    """The "tiny" preset's random weights on the CPU: token-id prompts, no tokenizer."""
    return LLMEngine.from_config("tiny", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64,
                                                      max_num_seqs=16), seed=1)


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=n) for n in NS]


def _check(outs: list[RequestOutput]) -> None:
    assert [o.request_id for o in outs] == IDS
    for out, n in zip(outs, NS, strict=True):
        assert out.finish_reason == "length" and out.num_output_tokens == 4
        if n == 1:
            assert out.samples is None
        else:
            assert len(out.samples) == n and all(s.request_id == out.request_id for s in out.samples)
            assert out.output_token_ids == out.samples[0].output_token_ids


def test_child_ids_never_collide_with_the_batch_ids() -> None:
    taken = {"a", f"a{CHILD_SEP}0"}
    ids = child_ids("a", 2, taken)
    assert ids == [f"a{CHILD_SEP}{CHILD_SEP}0", f"a{CHILD_SEP}{CHILD_SEP}1"] and taken.issuperset(ids)
    assert child_ids("b", 2, taken) == [f"b{CHILD_SEP}0", f"b{CHILD_SEP}1"]
    assert child_params(SamplingParams(seed=5, n=3), 2) == SamplingParams(seed=7, n=1)
    assert child_params(SamplingParams(n=3), 2).seed is None


def test_a_parent_joins_its_samples_or_aborts_them_all(tiny_engine: LLMEngine) -> None:
    parent = tiny_engine.make_requests([[1, 2, 3]], SamplingParams(n=2), request_ids=["p"])[0]
    assert isinstance(parent, ParentRequest) and [c.sampling_params.n for c in parent.children] == [1, 1]
    one, two = (RequestOutput(c.request_id, [1, 2, 3], [4 + j], "", "length", num_preemptions=j)
                for j, c in enumerate(parent.children))
    assert parent.add(two) is None  # in any order, by the child's id
    joined = parent.add(one)
    assert joined.request_id == "p" and joined.output_token_ids == [4] and joined.num_preemptions == 1
    assert [s.output_token_ids for s in joined.samples] == [[4], [5]]
    tiny_engine.abort_requests([c.request_id for c in parent.children])  # forget their logits-processor state
    parent = tiny_engine.make_requests([[1, 2, 3]], SamplingParams(n=2), request_ids=["q"])[0]
    tiny_engine.abort_requests([c.request_id for c in parent.children])
    parent.add(RequestOutput(parent.children[0].request_id, [1, 2, 3], [4], "", "length"))
    aborted = parent.add(RequestOutput(parent.children[1].request_id, [1, 2, 3], [], "", "abort"))
    assert aborted.request_id == "q" and aborted.finish_reason == "abort" and aborted.samples is None


def test_any_request_id_round_trips_with_n_samples(tiny_engine: LLMEngine) -> None:
    prompts = [[5 + i, 17, 99, 3 * i + 1] for i in range(len(IDS))]
    outs = tiny_engine.generate(prompts, _params(), request_ids=IDS)
    _check(outs)
    # A prompt's samples do not depend on its id, nor on its neighbours' ids: the same batch under plain ids.
    plain = tiny_engine.generate(prompts, _params())
    assert [[s.output_token_ids for s in o.samples or [o]] for o in outs] == \
        [[s.output_token_ids for s in o.samples or [o]] for o in plain]
    loop = EngineLoop(tiny_engine)
    try:
        got = loop.submit(prompts, _params(), request_ids=IDS).results()
    finally:
        loop.close(timeout_s=60)
    _check(got)
    assert [[s.output_token_ids for s in o.samples or [o]] for o in got] == \
        [[s.output_token_ids for s in o.samples or [o]] for o in outs]
    assert not tiny_engine.logits_processors.states and not tiny_engine.has_unfinished
