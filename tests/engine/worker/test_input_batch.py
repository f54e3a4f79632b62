"""engine.worker.input_batch: the persistent block table and the step inputs built from it equal a from-scratch build
from
the KV cache manager's lists at every step, while requests join, grow, finish, get preempted and come back, share
prefix-cache blocks, and leave without being removed. The scheduler runs for real over a small pool; the test plays
the model (a token drawn from the request's own rng for every request that samples)."""

from __future__ import annotations

import random

import numpy as np

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest, Scheduler
from engine.sample.sampler import SampledRows
from engine.sampling_params import SamplingParams
from engine.worker.input_batch import InputBatch, StepInputs


def _from_scratch(scheduled: list[ScheduledRequest], tables: dict[str, list[int]], bs: int) -> dict[str, object]:
    """The step's inputs as the model runner built them before the persistent batch: per request and per token
    from the lists, decodes first, block tables padded with 0."""
    scheduled = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
    ids, pos, slots, qlens, seq_lens, rows, logits_rows, sampling = [], [], [], [], [], [], [], []
    for req, n in scheduled:
        start = req.num_computed_tokens
        table = tables[req.request_id]
        ids += req.all_token_ids[start:start + n]
        pos += range(start, start + n)
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        qlens.append(n)
        seq_lens.append(start + n)
        rows.append(table)
        if start + n == req.num_tokens:
            logits_rows.append(len(ids) - 1)
            sampling.append(req.request_id)
    width = max(len(t) for t in rows)
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "query_lens": qlens, "seq_lens": seq_lens,
            "block_tables": [t + [0] * (width - len(t)) for t in rows], "logits_rows": logits_rows,
            "sampling": sampling, "query_start_loc": np.concatenate([[0], np.cumsum(qlens)]).tolist()}


def _as_lists(x: StepInputs) -> dict[str, object]:
    return {"input_ids": x.input_ids.tolist(), "positions": x.positions.tolist(),
            "slot_mapping": x.slot_mapping.tolist(), "query_lens": x.query_lens, "seq_lens": x.seq_lens.tolist(),
            "block_tables": x.block_tables.tolist(), "logits_rows": x.logits_rows.tolist(),
            "sampling": [r.request_id for r in x.sampling], "query_start_loc": x.query_start_loc.tolist()}


def _run(num_blocks: int, bs: int, max_num_seqs: int, budget: int, remove_finished: bool, seed: int) -> tuple[int, int]:
    """Run 40 requests (prompts sharing a 20-token head, 1-70 tokens long, 1-40 output tokens) to the end, checking
    every step. Returns (steps, preemptions)."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs, budget)
    head = [rng.randrange(100) for _ in range(20)]
    # Every third request greedy, the others sampled with their own temperature, top_p, top_k and seed (or none).
    reqs = [Request(f"r{i}", (head + [rng.randrange(100) for _ in range(70)])[:rng.randint(1, 70)],
                    SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True,
                                   temperature=0.0 if i % 3 == 0 else rng.uniform(0.1, 2.0),
                                   top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, -1, 5, 200]),
                                   seed=rng.choice([None, rng.randrange(1 << 63)])))
            for i in range(40)]
    sched.add_requests(reqs)
    batch = InputBatch(max_num_seqs, -(-200 // bs), bs)
    steps = 0
    while sched.has_unfinished:
        plan = sched.schedule()
        expected = _from_scratch(plan.scheduled, kv.block_tables, bs)
        x = batch.prepare(plan.scheduled, kv.block_tables)
        assert _as_lists(x) == expected, f"step {steps}"
        assert x.decode_only == all(n == 1 for _, n in plan.scheduled)
        # The sampling parameters kept in the batch's rows are the sampled requests' own, with their output counts.
        got = batch.sampled_rows(x)
        want = SampledRows.from_params([r.sampling_params for r in x.sampling],
                                       [len(r.output_token_ids) for r in x.sampling])
        assert (got is None) == (want is None), f"step {steps}"
        if want is not None:
            for name, a, b in zip(SampledRows._fields, got, want, strict=True):
                assert a.tolist() == b.tolist(), f"step {steps}: {name}"
        for req, _ in plan.scheduled:  # each row mirrors the manager's list exactly, past its end untouched
            row = batch.row_of[req.request_id]
            assert batch.block_table[row, :batch.num_blocks[row]].tolist() == kv.block_tables[req.request_id]
        finished = sched.update_from_output(plan, [(r, rng.randrange(100)) for r in x.sampling])
        if remove_finished:
            batch.remove(r.request_id for r in finished)
        kv.check_integrity()
        steps += 1
    if remove_finished:  # every row freed: no sampled row counted
        assert batch.num_rows == 0 and batch.num_sampled_rows == 0 and batch.greedy.all()
    return steps, sched.num_preemptions


def test_persistent_batch_equals_a_from_scratch_build_through_joins_growth_preemption_and_prefix_hits() -> None:
    steps, preemptions = _run(num_blocks=40, bs=4, max_num_seqs=8, budget=48, remove_finished=True, seed=0)
    assert preemptions > 5 and steps > 50  # the small pool preempts; chunks of the 48-token budget mix in


def test_rows_of_requests_that_left_unannounced_are_swept_and_reused() -> None:
    # No remove(): finished requests keep their rows until new ones need them; a stale row is never read.
    steps, preemptions = _run(num_blocks=30, bs=4, max_num_seqs=6, budget=20, remove_finished=False, seed=1)
    assert preemptions > 0 and steps > 50


def test_rows_are_reused_and_added_when_needed() -> None:
    kv = KVCacheManager(64, 4)
    batch = InputBatch(2, 8, 4)
    reqs = [Request(f"r{i}", list(range(i * 10, i * 10 + 6)), SamplingParams()) for i in range(3)]
    for r in reqs:
        kv.allocate_slots(r, 6)
    rows = [batch.sync_row(r.request_id, kv.block_tables) for r in reqs]  # the third doubles the rows
    assert sorted(rows) == [0, 1, 2] and batch.block_table.shape == (4, 8) and batch.num_rows == 3
    batch.remove(["r0"])
    kv.free(reqs[0])
    late = Request("late", [5, 6, 7], SamplingParams())
    kv.allocate_slots(late, 3)
    assert batch.sync_row("late", kv.block_tables) == rows[0]  # the freed row, rewritten
    assert batch.block_table[rows[0], :1].tolist() == kv.block_tables["late"] and batch.num_blocks[rows[0]] == 1
