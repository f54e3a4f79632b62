"""Scheduler: admission under limits, chunked prefill, preemption of the newest, in-batch prefix sharing, stop
conditions. No model: the test plays the model runner (a fixed token for every request that samples) and hands its
output to the scheduler's own update path (`update_from_output`)."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.sampling_params import SamplingParams


def _requests(lengths: list[int], max_tokens: int = 4, shared: int = 0) -> list[Request]:
    """Requests with prompts of the given lengths; the first `shared` tokens are the same in all, the rest differ."""
    return [Request(f"r{i}", [1 + t if t < shared else 1000 * (i + 1) + t for t in range(n)],
                    SamplingParams(max_tokens=max_tokens))
            for i, n in enumerate(lengths)]


def _apply(sched: Scheduler, plan: SchedulerOutput) -> list[Request]:
    """Play the model for a step: every request whose step reaches its last token samples token 7; the scheduler's
    own update path applies it. Returns the requests that finished."""
    sampled = [(r, 7) for r, n in plan.scheduled if r.num_computed_tokens + n == r.num_tokens]
    finished = sched.update_from_output(plan, sampled)
    sched.kv_cache_manager.check_integrity()
    return finished


def _run_step(sched: Scheduler) -> list[Request]:
    """Schedule and apply one step (requests finish at max_tokens: "length"). Returns the finished requests."""
    return _apply(sched, sched.schedule())


def test_admission_respects_max_num_seqs_and_token_budget() -> None:
    sched = Scheduler(KVCacheManager(100, 4), max_num_seqs=2, max_num_batched_tokens=20)
    reqs = _requests([8, 8, 8])
    sched.add_requests(reqs)
    plan = sched.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["r0", "r1"]  # max_num_seqs = 2
    assert sum(s.num_new_tokens for s in plan.scheduled) == 16 and len(sched.waiting) == 1

    sched2 = Scheduler(KVCacheManager(100, 4), max_num_seqs=8, max_num_batched_tokens=12)
    sched2.add_requests(_requests([8, 8]))
    plan2 = sched2.schedule()
    # Budget 12: r0 prefills all 8 tokens, r1 gets a 4-token chunk (chunked prefill).
    assert [(s.request.request_id, s.num_new_tokens) for s in plan2.scheduled] == [("r0", 8), ("r1", 4)]


def _prefill_chunks(sched: Scheduler, req: Request) -> list[int]:
    """Run `req`, alone in `sched`, until its first output token: the tokens of each of its prefill chunks."""
    sched.add_requests([req])
    chunks = []
    while req.num_output_tokens == 0:
        plan = sched.schedule()
        chunks.append(plan.scheduled[0].num_new_tokens)
        _apply(sched, plan)
    return chunks


def test_chunked_prefill_of_a_long_prompt() -> None:
    sched = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=10)
    (req,) = _requests([25], max_tokens=2)
    assert _prefill_chunks(sched, req) == [10, 10, 5]


def test_preemption_frees_newest_and_everything_completes() -> None:
    # 3 requests of 8 prompt tokens + 8 output tokens need 4 blocks of 4 each at the end; the pool has 9.
    kv = KVCacheManager(num_blocks=9, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = _requests([8, 8, 8], max_tokens=8)
    sched.add_requests(reqs)
    done: list[Request] = []
    steps = 0
    while sched.has_unfinished:
        done += _run_step(sched)
        steps += 1
        assert steps < 200, "scheduler made no progress"
    assert sched.num_preemptions >= 1
    assert reqs[-1].num_preemptions >= 1 and reqs[0].num_preemptions == 0  # the newest is preempted, not the oldest
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    assert all(r.status is RequestStatus.FINISHED and r.num_output_tokens == 8 for r in done)
    assert kv.num_free_blocks == 9 and not kv.block_tables  # no leak


def test_preempted_request_recomputes_its_outputs() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _requests([8, 8], max_tokens=6)
    sched.add_requests([a, b])
    while b.num_preemptions == 0:
        _run_step(sched)
    # b lost its blocks: it waits at the head of the queue and will recompute prompt + outputs so far.
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and sched.waiting[0] is b
    assert b.request_id not in kv.block_tables
    while sched.has_unfinished:
        _run_step(sched)
    assert b.num_output_tokens == 6 and a.num_output_tokens == 6


def test_requests_sharing_a_prefix_with_one_being_computed_wait_a_step_and_reuse_its_blocks() -> None:
    kv = KVCacheManager(100, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100)
    # r0..r2 share 9 tokens (2 full blocks of 4); r3 shares nothing.
    reqs = _requests([14, 12, 11], shared=9) + [Request("r3", list(range(500, 510)), SamplingParams(max_tokens=4))]
    sched.add_requests(reqs)
    plan = sched.schedule()
    # r1 and r2 would compute the blocks r0 computes in this step: they wait; r3 does not share, so it runs.
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("r0", 14), ("r3", 10)]
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"]
    _apply(sched, plan)
    plan = sched.schedule()
    # Next step they find r0's two shared blocks in the cache and prefill only the rest.
    new = {s.request.request_id: s.num_new_tokens for s in plan.scheduled}
    assert new == {"r0": 1, "r3": 1, "r1": 12 - 8, "r2": 11 - 8}
    assert kv.block_tables["r1"][:2] == kv.block_tables["r0"][:2] == kv.block_tables["r2"][:2]
    assert kv.pool.num_cache_hits == 4
    kv.check_integrity()
    while sched.has_unfinished:
        _run_step(sched)
    assert all(r.num_output_tokens == 4 for r in reqs)


def test_a_chunked_shared_prefix_is_computed_once_chunk_by_chunk() -> None:
    kv = KVCacheManager(100, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    reqs = _requests([20, 20], shared=17)  # 4 shared full blocks, prefilled 8 tokens a step
    sched.add_requests(reqs)
    computed_by_r1 = 0
    while reqs[1].num_output_tokens == 0:
        plan = sched.schedule()
        computed_by_r1 += sum(n for r, n in plan.scheduled if r is reqs[1])
        _apply(sched, plan)
    # r1 waited while r0 computed the shared blocks, then computed only what follows them.
    assert computed_by_r1 == 20 - 16
    assert kv.block_tables["r1"][:4] == kv.block_tables["r0"][:4]


def test_prefix_caching_off_admits_without_waiting() -> None:
    sched = Scheduler(KVCacheManager(100, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add_requests(_requests([14, 12], shared=9))
    assert [s.request.request_id for s in sched.schedule().scheduled] == ["r0", "r1"]


def test_update_from_output_advances_counters_and_finishes_on_eos_stop_ids_and_length() -> None:
    kv = KVCacheManager(100, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=100, eos_token_id=2, max_model_len=13)
    eos, stop_id, length, capped, ignore = (
        Request("eos", [10, 11, 12], SamplingParams(max_tokens=5)),
        Request("stop_id", [20, 21, 22], SamplingParams(max_tokens=5, stop_token_ids=[9])),
        Request("length", [30, 31, 32], SamplingParams(max_tokens=2)),
        Request("capped", list(range(40, 51)), SamplingParams(max_tokens=50)),  # 11 + 2 = max_model_len 13
        Request("ignore", [60, 61, 62], SamplingParams(max_tokens=2, ignore_eos=True)))
    reqs = [eos, stop_id, length, capped, ignore]
    sched.add_requests(reqs)
    plan = sched.schedule()
    assert sched.update_from_output(plan, [(r, 5) for r in reqs]) == []
    assert [r.num_computed_tokens for r in reqs] == [3, 3, 3, 11, 3]  # prompts computed, one token appended each
    assert all(r.num_output_tokens == 1 and r.first_token_time is not None for r in reqs)
    plan = sched.schedule()
    assert [n for _, n in plan.scheduled] == [1] * 5  # decodes
    finished = sched.update_from_output(plan, [(eos, 2), (stop_id, 9), (length, 5), (capped, 5), (ignore, 2)])
    assert {r.request_id: r.finish_reason for r in finished} == {
        "eos": "stop", "stop_id": "stop", "length": "length", "capped": "length", "ignore": "length"}
    assert all(r.status is RequestStatus.FINISHED and r.finish_time is not None for r in reqs)
    assert not sched.has_unfinished and kv.num_free_blocks == 100 and not kv.block_tables
    kv.check_integrity()


def test_whole_images_end_no_prefill_chunk_inside_an_image() -> None:
    """A model whose image placeholders attend to each other (whole_images): a chunk ends before an image it would
    split, and a request whose image does not fit the step's leftover budget waits while the others run."""
    import torch

    from engine.multimodal.inputs import MultiModalItem

    def image(offset: int, length: int) -> MultiModalItem:
        return MultiModalItem(torch.zeros(1), offset, length, f"image{offset}")

    sched = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=10, whole_images=True)
    req = Request("r", list(range(100, 130)), SamplingParams(max_tokens=2), mm_items=(image(4, 8), image(14, 6)))
    # [0, 4) before the image at [4, 12); [4, 14); [14, 24) past the one at [14, 20)
    assert _prefill_chunks(sched, req) == [4, 10, 10, 6]

    sched = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=10, whole_images=True)
    text, pictured = _requests([9])[0], Request("p", list(range(200, 212)), SamplingParams(max_tokens=2),
                                                mm_items=(image(0, 8),))
    sched.add_requests([text, pictured])
    plan = sched.schedule()  # one token left: "p" would end inside its image
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("r0", 9)]
    _apply(sched, plan)
    assert [(s.request.request_id, s.num_new_tokens) for s in sched.schedule().scheduled] == [("r0", 1), ("p", 9)]

    # running: "p" reaches its image of 10 while "r0" decodes, so 9 tokens are left: it waits until r0 is done
    sched = Scheduler(KVCacheManager(100, 4), max_num_seqs=4, max_num_batched_tokens=10, whole_images=True)
    text, pictured = _requests([9], max_tokens=3)[0], Request("p", list(range(200, 224)), SamplingParams(max_tokens=2),
                                                              mm_items=(image(4, 10),))
    sched.add_requests([text, pictured])
    steps = []
    while pictured.num_output_tokens == 0:
        plan = sched.schedule()
        steps.append([(s.request.request_id, s.num_new_tokens) for s in plan.scheduled])
        _apply(sched, plan)
    assert steps == [[("r0", 9), ("p", 1)], [("r0", 1), ("p", 3)], [("r0", 1)], [("p", 10)], [("p", 10)]]
