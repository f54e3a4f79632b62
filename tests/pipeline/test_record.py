"""The shard's record (pipeline.record.ShardRecord) is its one reader: a shard run lists its attempt records once,
and `status` reads a shard from one snapshot."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem
from shard_helpers import ROWS, interrupt_after, shard_cfg

from engine import LLMEngine
from pipeline.input import Shard
from pipeline.record import ShardRecord
from pipeline.shard import run_shard
from pipeline.status import shard_state

LISTINGS = ("ls", "find", "glob", "walk")


@pytest.fixture()
def listings(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the listings the local filesystem (fsspec) is asked for, by the listed path relative to OUTPUT's
    parent folder's name pattern ("attempts/<shard>", "checkpoints/<shard>", ...); a listing made inside another
    (find through ls) counts once, as its outer call."""
    counts: Counter[str] = Counter()
    depth = [0]

    def counting(method: Callable[..., Any]) -> Callable[..., Any]:
        def listing(self: LocalFileSystem, path: str, *args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                parts = str(path).rstrip("/").split("/")
                counts["/".join(parts[-2:])] += 1
            depth[0] += 1
            try:
                return method(self, path, *args, **kwargs)
            finally:
                depth[0] -= 1
        return listing

    for name in LISTINGS:
        monkeypatch.setattr(LocalFileSystem, name, counting(getattr(LocalFileSystem, name)))
    yield counts


def test_a_shard_run_lists_its_attempts_once(waves: LLMEngine, shard: Shard, tmp_path: Path,
                                             listings: Counter[str]) -> None:
    """An interrupted run, then the run that resumes and finishes it (billing the first): each lists attempts/ once
    and checkpoints/ at most twice (at its start, and once more to merge its parts); a rerun of the finished shard
    lists attempts/ once to find its accounting."""
    out = str(tmp_path / "out")
    attempts, checkpoints = f"attempts/{shard.shard_id}", f"checkpoints/{shard.shard_id}"
    interrupt_after(waves, shard, out, shard_cfg(checkpoint_rows=2), rows=4)
    assert listings[attempts] == 1 and listings[checkpoints] == 1  # stopped before merging: one of each
    listings.clear()

    acct = run_shard(waves, shard, "question", out, shard_cfg(checkpoint_rows=2))
    assert (acct["rows"], acct["attempts"], acct["preemptions"]) == (ROWS, 2, 1)
    assert listings[attempts] == 1 and listings[checkpoints] == 2
    listings.clear()

    assert run_shard(waves, shard, "question", out, shard_cfg(checkpoint_rows=2)) == acct
    assert listings[attempts] == 1 and listings[checkpoints] == 0
    listings.clear()

    done = shard_state(out, shard.shard_id)
    assert (done.state, done.attempts, done.accounting) == ("done", 2, acct)
    assert listings[attempts] == 1 and listings[checkpoints] == 0


def test_the_snapshot_reads_each_folder_once_and_claims_from_its_listing(tmp_path: Path,
                                                                        listings: Counter[str]) -> None:
    """A ShardRecord lists a folder when first asked and keeps it; a claim takes the next number from that listing
    and joins the snapshot, and a number a racing run took meanwhile joins it too."""
    out = str(tmp_path / "out")
    record = ShardRecord.open(out, "00000-000000000")
    assert record.attempts.latest == 0 and record.parts == [] and not record.results_committed
    assert record.attempts.latest == 0 and record.parts == []
    assert listings["attempts/00000-000000000"] == 1 and listings["checkpoints/00000-000000000"] == 1

    racer = ShardRecord.open(out, "00000-000000000").claim()  # lists on its own: 0 claimed, takes 1
    first = record.claim(heartbeat_s=30.0)  # still believes 0 claimed: 1 is taken, so it gets 2
    assert (racer.number, first.number) == (1, 2)
    assert set(record.attempts.started) == {1, 2} and record.attempts.started[2] == first.started_at
    assert listings["attempts/00000-000000000"] == 2  # one per record: the claim listed nothing more
    assert record.start_record(2)["heartbeat_s"] == 30.0 and record.end_record(2) == {}
    first.interrupt(rows_committed=0, device_s=1.5, reason="SIGTERM")
    assert record.end_record(2)["device_s"] == 1.5
    fresh = ShardRecord.read(out, "00000-000000000")
    assert set(fresh.attempts.ended) == {2} and fresh.record_failure("broken input") == 3
    assert shard_state(out, "00000-000000000").last_error == "broken input"
