"""Two shards at once on one resident engine loop (engine.loop.engine_loop), as a worker's shard slots run them: a stop
with both in flight commits both shards' finished rows and a rerun completes every id once; one shard's unreadable
file never stops the other's rows; the two shards' device-seconds add up to the time they shared the engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from shard_helpers import ROWS, shard_cfg

from engine import EngineConfig, LLMEngine
from engine.loop.engine_loop import EngineLoop
from pipeline.checkpoint import committed_parts
from pipeline.input import Shard
from pipeline.layout import results_path
from pipeline.shard import ShardError, ShardInterrupted, run_shard
from pipeline.storage import output_fs


@pytest.fixture()
def loop(engine: LLMEngine) -> Iterator[EngineLoop]:
    """A loop over the tiny engine, 4 rows at a time (rows finish in waves, so a stop lands mid-shard)."""
    loop = EngineLoop(engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=4)))
    yield loop
    loop.close(timeout_s=30)
    assert not loop.engine.scheduler.has_unfinished


def _halves(rows_file: str) -> list[Shard]:
    return [Shard(f"00000-{start:09d}", rows_file, f"file://{rows_file}", start, start + ROWS // 2)
            for start in (0, ROWS // 2)]


def _in_threads(*calls: Callable[[], Any]) -> list[Any]:
    """Run each call in its own thread (a worker's shard slots); return each one's result or exception."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as e:  # the test looks at it
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_a_stop_with_both_shards_in_flight_commits_both_and_a_rerun_finishes(
        loop: EngineLoop, rows_file: str, reference: Any, tmp_path: Path) -> None:
    shards, out = _halves(rows_file), str(tmp_path / "out")
    cfg = shard_cfg(checkpoint_rows=1)
    finished = {s.shard_id: 0 for s in shards}
    stop = threading.Event()

    def progress_of(shard_id: str) -> Callable[[int, int], None]:
        def progress(rows: int, tokens: int) -> None:
            finished[shard_id] += rows
            if all(n >= 2 for n in finished.values()):  # both have committed rows and have rows in flight
                stop.set()
        return progress

    stopped = _in_threads(*[lambda s=s: run_shard(loop, s, "question", out, cfg, progress=progress_of(s.shard_id),
                                                  should_stop=stop.is_set) for s in shards])
    assert all(isinstance(e, ShardInterrupted) for e in stopped), stopped
    fs, root = output_fs(out)
    for shard, e in zip(shards, stopped, strict=True):
        assert e.rows_committed >= 2 and e.rows_committed + e.rows_in_flight == ROWS // 2
        assert sum(p.rows for p in committed_parts(fs, root, shard.shard_id)) == e.rows_committed

    rerun = _in_threads(*[lambda s=s: run_shard(loop, s, "question", out, cfg) for s in shards])
    assert all(isinstance(r, dict) for r in rerun), rerun
    for acct, e in zip(rerun, stopped, strict=True):
        assert acct["attempts"] == 2 and acct["rows_resumed"] == e.rows_committed
    results = [pq.read_table(results_path(out, s.shard_id)).to_pylist() for s in shards]
    ids = [r["id"] for half in results for r in half]
    assert ids == reference.column("id").to_pylist()  # every id once, in row order
    # Greedy: the same completions as one undisturbed run of the whole file on an engine of its own.
    assert [r["completion"] for half in results for r in half] == reference.column("completion").to_pylist()


def test_an_unreadable_file_never_stops_the_other_shards_rows(loop: EngineLoop, rows_file: str, reference: Any,
                                                               tmp_path: Path) -> None:
    bad_file = tmp_path / "bad.parquet"
    bad_file.write_bytes(b"PAR1 this is not a parquet file")
    good = Shard("00000-000000000", rows_file, f"file://{rows_file}", 0, ROWS)
    bad = Shard("00001-000000000", str(bad_file), f"file://{bad_file}", 0, 4)
    out = str(tmp_path / "out")
    ok, failed = _in_threads(lambda: run_shard(loop, good, "question", out, shard_cfg(checkpoint_rows=2)),
                             lambda: run_shard(loop, bad, "question", out, shard_cfg()))
    assert isinstance(failed, ShardError) and "bad.parquet" in str(failed)
    assert isinstance(ok, dict) and ok["rows"] == ROWS
    assert pq.read_table(results_path(out, good.shard_id)).column("completion").to_pylist() == \
        reference.column("completion").to_pylist()


def test_shards_sharing_the_engine_are_billed_its_time_once(loop: EngineLoop, rows_file: str,
                                                             tmp_path: Path) -> None:
    shards, out = _halves(rows_file), str(tmp_path / "out")
    walls: dict[str, float] = {}

    def timed(shard: Shard) -> dict[str, Any]:
        t = time.monotonic()
        try:
            return run_shard(loop, shard, "question", out, shard_cfg(checkpoint_rows=1000))
        finally:
            walls[shard.shard_id] = time.monotonic() - t

    accts = _in_threads(*[lambda s=s: timed(s) for s in shards])
    assert all(isinstance(a, dict) for a in accts), accts
    billed = [a["device_s"] for a in accts]
    assert all(0 < b <= walls[a["shard_id"]] for a, b in zip(accts, billed, strict=True))
    # Both ran side by side nearly all along: billed by wall time they would come to about twice the longer one;
    # by their token shares of the shared steps (plus the moments no step ran) to about the longer one.
    assert sum(billed) < 1.5 * max(walls.values())
