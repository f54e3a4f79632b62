"""The job lease on create-only storage: one holder, renewal, expiry and takeover, release, races; local and on a
flaky S3. No model, no cluster."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import jobs.lease
from jobs.errors import EXIT_LEASE_HELD
from jobs.lease import Lease, LeaseHeld, newest_record


def test_second_holder_is_refused_with_holder_and_expiry(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    first = Lease(out, ttl_s=30, holder="host-a:1:run1")
    record = first.acquire()
    assert (record.seq, record.holder) == (0, "host-a:1:run1") and record.active()
    with pytest.raises(LeaseHeld) as e:
        Lease(out, ttl_s=30, holder="host-b:2:run2").acquire()
    assert e.value.exit_code == EXIT_LEASE_HELD
    assert "host-a:1:run1" in str(e.value) and "lease until" in str(e.value) and "s from now" in str(e.value)
    assert newest_record(out) == record


def test_an_expired_lease_is_taken_over_and_its_old_holder_learns_it_lost(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    stale = Lease(out, ttl_s=0.2, holder="crashed")
    stale.acquire()
    time.sleep(0.3)  # the holder died: no renewal
    taker = Lease(out, ttl_s=30, holder="next")
    assert taker.acquire().seq == 1
    assert stale.renew() is False and stale.lost.is_set()  # its next seq is taken: it must stop
    assert newest_record(out).holder == "next"


def test_the_holder_renews_in_the_background_and_releases_at_the_end(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On the test's own clock (jobs.lease's time.time): lease time passes only when the test moves it, and each
    move waits for the renewal thread's next record, so a renewal thread starved by a busy machine never lets the
    lease expire under the test. The renewals run on their real ttl/3 timer."""
    out = str(tmp_path / "out")
    now = [time.time()]
    monkeypatch.setattr(jobs.lease, "time", SimpleNamespace(time=lambda: now[0]))
    with Lease(out, ttl_s=0.6, holder="busy") as lease:
        for _ in range(3):  # 3 x 0.5 s > 2 TTLs: only renewal keeps it
            now[0] += 0.5  # less than a TTL: the newest record is still live
            guard = time.monotonic() + 120  # a hang guard only
            while newest_record(out).acquired_at != now[0]:  # a renewal made at the new time
                assert time.monotonic() < guard, "the lease was not renewed"
                time.sleep(0.01)
        newest = newest_record(out)
        assert newest.holder == "busy" and newest.active() and newest.seq >= 3
        with pytest.raises(LeaseHeld):
            Lease(out, ttl_s=0.6, holder="other").acquire()
        assert not lease.lost.is_set()
    assert newest_record(out).released
    assert len(list((tmp_path / "out" / "_lease").iterdir())) <= 3  # old records are tidied away
    assert Lease(out, ttl_s=0.6, holder="other").acquire().holder == "other"  # no wait for the expiry


def test_racing_takers_get_exactly_one_lease(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    barrier = threading.Barrier(8)
    won: list[str] = []

    def take(i: int) -> None:
        barrier.wait()
        with contextlib.suppress(LeaseHeld):
            won.append(Lease(out, ttl_s=30, holder=f"racer-{i}").acquire().holder)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and newest_record(out).holder == won[0]


def test_an_unreadable_record_is_skipped_with_a_warning_not_a_lock(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A record cut short (a full disk or a crash under a version without atomic writes) holds nothing: the run
    takes the lease at once, above it, and says which record it skipped. A readable live record below it still
    holds the job."""
    out = tmp_path / "out"
    (out / "_lease").mkdir(parents=True)
    (out / "_lease" / "000000000004.json").write_text('{"holder": "cut sh')
    (out / "_lease" / "000000000005.json").write_bytes(b"")  # the 0-byte record a full disk left
    with caplog.at_level("WARNING", logger="jobs.lease"):
        assert Lease(str(out), ttl_s=30, holder="next").acquire().seq == 6
    assert "unreadable lease record" in caplog.text and "000000000005.json" in caplog.text
    assert newest_record(str(out)).holder == "next"
    (out / "_lease" / "000000000007.json").write_bytes(b"")
    with pytest.raises(LeaseHeld, match="next"):  # the live record under the unreadable one still holds the job
        Lease(str(out), ttl_s=30, holder="rival").acquire()


def test_lease_on_a_flaky_s3() -> None:
    """Refused requests are retried; a claim whose answer was lost is recognised as ours (not a rival's)."""
    from s3_faults import flaky_s3

    with flaky_s3(rate=0.2, lost_rate=0.3, seed=5) as s3:
        out = f"s3://{s3.bucket}/job"
        lease = Lease(out, ttl_s=30, holder="mine")
        assert lease.acquire().holder == "mine"
        for _ in range(4):
            assert lease.renew() is True
        with pytest.raises(LeaseHeld):
            Lease(out, ttl_s=30, holder="rival").acquire()
        lease.release()
        assert newest_record(out).released
        assert s3.faults.stats.lost.get("PUT", 0) > 0


def test_the_run_that_loses_the_race_to_a_job_of_another_input_is_told_the_mismatch_at_once(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs start on one OUTPUT with different inputs: both find no manifest, the other one takes the lease and
    pins its input first. The loser says the input mismatch (exit 2) at once, not "wait and rerun" (exit 3), whose
    rerun would only be refused for the input."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    import jobs.runner
    from jobs.cli import app
    from pipeline.config import RunConfig
    from pipeline.manifest import pin_manifest

    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"])
    mine, theirs = tmp_path / "mine.parquet", tmp_path / "theirs.parquet"
    pq.write_table(table.slice(0, 4), mine)
    pq.write_table(table.slice(4, 4), theirs)
    out = tmp_path / "out"
    winner = Lease(str(out), ttl_s=60, holder="other-host:123:abcd")

    class LosesTheRace(Lease):
        def __enter__(self) -> Lease:  # between this run's checks and its lease, the other run wins and pins
            winner.acquire()
            pin_manifest(str(out), str(theirs), RunConfig(prompt_column="question", max_tokens=2))
            return super().__enter__()

    monkeypatch.setattr(jobs.runner, "Lease", LosesTheRace)
    res = CliRunner().invoke(app, ["run", str(mine), str(out), "--prompt-column", "question", "--max-tokens", "2"])
    assert res.exit_code == 2, res.output
    assert "theirs.parquet" in res.output and "another run holds the job now" in res.output
    assert "other-host:123:abcd" in res.output
