"""A worker runs several shards at once on its one resident engine (jobs.plugin.shard_slots): a SIGTERM with 2 or 16
shards in flight stops them through the same drain path, each commits its finished rows and is billed its share of
the worker's time (the shares add up to that time once), and the job finishes with every id once. Real GSM8K rows,
the tiny model, `run_job` on a LocalCluster of its own (one worker, 2 or 16 slots)."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import dask
import pyarrow.parquet as pq
import pytest
from gsm8k_rows import write_gsm8k
from held_shard import PRELOAD, held_attempts, preload_env

from engine import EngineConfig
from jobs.cluster import ClusterOptions
from jobs.errors import JobError
from jobs.plugin import MAX_SHARD_SLOTS, shard_slots
from jobs.runner import run_job
from pipeline.config import RunConfig
from pipeline.layout import end_path, start_path

ENGINE = EngineConfig(device="cpu", dtype="float32", max_num_seqs=2, kv_cache_memory_bytes=256 << 20)
ROWS_PER_SHARD = 12


def test_slots_keep_the_batch_full_while_a_shard_drains() -> None:
    assert shard_slots(256, 1024) == 2 and shard_slots(256, 256) == 2
    assert shard_slots(256, 64) == 8  # ceil(256 / 64) + 1 = 5, rounded up to a power of two
    assert shard_slots(4096, 8) == MAX_SHARD_SLOTS
    with pytest.raises(JobError, match="power of two"):
        ClusterOptions(shard_slots=3)
    with pytest.raises(ValueError, match=">= 1"):
        shard_slots(0, 64)


@pytest.mark.parametrize(("shards", "rows_per_shard"), [(2, ROWS_PER_SHARD), (MAX_SHARD_SLOTS, 3)],
                         ids=["2-slots", "16-slots"])
def test_sigterm_with_shards_in_one_engine_commits_each(data_dir: Path, tmp_path: Path, shards: int,
                                                        rows_per_shard: int) -> None:
    """The worker loads hold_shard_preload.py, armed to let every shard into its engine before the first step and
    to hold the engine once each has finished a row: the SIGTERM always finds all `shards` in flight, each with a
    committed part, however fast or loaded the machine is. With 16 slots (the most a worker runs) the stopped
    attempts' device-seconds still add up to the worker's time once (issue 51: a test with 16 slots cut by SIGTERM)."""
    ids = write_gsm8k(data_dir, tmp_path / "in", 800, shards * rows_per_shard)
    cfg = RunConfig(prompt_column="question", max_tokens=16, rows_per_shard=rows_per_shard, checkpoint_rows=1)
    out, claim = tmp_path / "out", tmp_path / "hold-claim"
    sent: list[tuple[set[int], list[str]]] = []
    job_ended = threading.Event()

    def terminate_when_both_held() -> None:
        pid, held = held_attempts(out, claim, shards=shards, running=lambda: not job_ended.is_set())
        sent.append(({pid}, [shard_id for shard_id, _ in held]))
        os.kill(pid, signal.SIGTERM)

    watcher = threading.Thread(target=terminate_when_both_held, daemon=True)
    watcher.start()
    with pytest.MonkeyPatch.context() as mp, dask.config.set({"distributed.worker.preload": [str(PRELOAD)]}):
        for name, value in preload_env(claim, after_rows=1, shards=shards).items():
            mp.setenv(name, value)  # the worker processes' environment: dask_setup arms from it
        summary = run_job(str(tmp_path / "in"), str(out), cfg, engine_config=ENGINE, workers=1, shard_slots=shards)
    job_ended.set()
    watcher.join()
    assert sent, f"the {shards} shards were never all in flight with a commit"
    pids, stopped = sent[0]
    assert len(pids) == 1  # one worker process: the shards shared its engine
    # The interruptions are checked below from their end records; the client's count can miss one whose
    # report raced the worker's restart, so it only has to see the signal at all.
    assert summary.shards_ok == shards and not summary.failed and summary.interruptions >= 1
    rows = pq.read_table(out / "results").to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(ids)  # every id exactly once
    assert len(stopped) == shards
    acct = {r["shard_id"]: r for r in pq.read_table(out / "accounting").to_pylist()}
    # Each held shard either stopped through the drain path with its finished rows committed, or (with 16 slots and
    # two sequences a step, a shard whose rows all ran before the last held shard finished its first) finished in
    # that attempt: every one of the worker's attempts is billed, by its end record or its accounting.
    ends, interrupted = [], []
    for shard_id in stopped:
        started_at = json.loads(Path(start_path(str(out), shard_id, 1)).read_text())["started_at"]
        end_file = Path(end_path(str(out), shard_id, 1))
        if not end_file.exists():
            assert acct[shard_id]["attempts"] == 1 and acct[shard_id]["rows"] == rows_per_shard, acct[shard_id]
            ends.append({"device_s": acct[shard_id]["device_s"], "started_at": started_at})
            continue
        end = json.loads(end_file.read_text())
        assert end["outcome"] == "interrupted" and end["reason"] == "SIGTERM" and end["rows_committed"] >= 1
        ends.append(end | {"started_at": started_at})
        interrupted.append(shard_id)
    assert len(interrupted) == shards if shards == 2 else len(interrupted) >= 2, interrupted
    # The worker's attempts shared its engine: their device-seconds add up to its time once (first claim to last end
    # record), not once per shard (issue 51 item 2).
    held = max(e["ended_at"] for e in ends if "ended_at" in e) - min(e["started_at"] for e in ends)
    assert 0.95 * held - 0.05 <= sum(e["device_s"] for e in ends) <= 1.05 * held + 0.05, (ends, held)
    for s in interrupted:
        assert acct[s]["attempts"] >= 2 and acct[s]["preemptions"] >= 1 and acct[s]["rows_resumed"] >= 1
