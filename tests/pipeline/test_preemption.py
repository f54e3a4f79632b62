"""Stops on the real engine: should_stop then resume, a real SIGTERM to a child process, the notice file, the cancel
marker, and the notice URL against a local HTTP server."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shard_helpers import ROWS, CountingEngine, interrupt_after, shard_cfg

from engine import LLMEngine
from pipeline.attempts import list_attempts, read_record
from pipeline.input import Shard
from pipeline.layout import cancel_path, end_path, results_path
from pipeline.preemption import (
    DEADLINE_ENV,
    NOTICE_FILE_ENV,
    POLL_ENV,
    StopSignal,
    install_sigterm_handler,
    stop_deadline_s,
)
from pipeline.shard import ShardInterrupted, run_shard
from pipeline.storage import output_fs

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 120.0  # only so that a broken test ends: every wait here ends on an event


def _end_record(out: str, shard: Shard, attempt: int) -> dict:
    fs, root = output_fs(out)
    return read_record(fs, end_path(root, shard.shard_id, attempt))


def _resume_and_check(waves: LLMEngine, shard: Shard, out: str, reference: pa.Table, committed: int) -> dict:
    """Run the shard again: it must generate exactly the uncommitted rows and end with the undisturbed results."""
    counting = CountingEngine(waves)
    acct = run_shard(counting, shard, "question", out, shard_cfg())
    assert counting.prompts == ROWS - committed  # the null row is committed with the first part
    assert pq.read_table(results_path(out, shard.shard_id)).to_pylist() == reference.to_pylist()
    assert (acct["attempts"], acct["preemptions"], acct["rows_resumed"]) == (2, 1, committed)
    return acct


def test_stopped_shard_commits_finished_rows_and_resumes_with_only_the_rest(
        waves: LLMEngine, shard: Shard, reference: pa.Table, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    stopped = interrupt_after(waves, shard, out, shard_cfg(checkpoint_rows=3), 6)
    committed = stopped.rows_committed
    assert stopped.rows_in_flight == ROWS - committed
    end = _end_record(out, shard, 1)
    assert (end["outcome"], end["rows_committed"], end["reason"]) == ("interrupted", committed, "should_stop")
    acct = _resume_and_check(waves, shard, out, reference, committed)
    # Attempt 1 wrote its device time in its end record: billed exactly, lost time after its stop commit only.
    assert acct["device_s_billed"] == pytest.approx(acct["device_s"] + end["device_s"])
    assert 0.0 <= acct["device_s_lost"] < end["device_s"]
    assert acct["cost_usd"] == pytest.approx(acct["device_s_billed"] / 3600 * acct["price_per_hour_usd"])


_CHILD = """
import json, os, sys, time
from engine import EngineConfig, LLMEngine
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.preemption import StopSignal, install_sigterm_handler
from pipeline.shard import ShardInterrupted, run_shard

path, out, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
stop = StopSignal()
install_sigterm_handler(stop)
engine = LLMEngine.from_model(os.environ.get("TOKENMILL_MODEL"), EngineConfig(device="cpu", dtype="float32",
                                                                            max_num_seqs=4))

printed = [0]

def progress(finished, tokens):  # called in the engine's own thread (generate's on_output)
    for _ in range(finished):
        print("row", flush=True)
    printed[0] += finished
    while printed[0] >= 5 and not stop.is_set():  # the test's own timing: hold the engine until the signal lands
        time.sleep(0.01)

try:
    run_shard(engine, Shard("00000-000000000", path, "file://" + path, 0, rows), "question", out,
              RunConfig(prompt_column="question", max_tokens=16, checkpoint_rows=1000), progress=progress,
              should_stop=stop.is_set)
    print(json.dumps({"finished": True}), flush=True)
except ShardInterrupted as e:
    print(json.dumps({"committed": e.rows_committed, "in_flight": e.rows_in_flight, "reason": stop.reason}),
          flush=True)
"""


def test_sigterm_commits_finished_rows_and_the_process_exits_cleanly(
        waves: LLMEngine, shard: Shard, reference: pa.Table, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": str(REPO), DEADLINE_ENV: "10"}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, shard.path, out, str(ROWS)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        # checkpoint_rows is large: only the stop commit can save these rows. Wait for the null row and a wave (the
        # child holds its engine from the fifth row until the signal: rows are in flight however fast it runs).
        while sum(line == "row" for line in lines) < 5:
            line = child.stdout.readline()
            assert line, f"the child ended before any rows finished: {lines}"
            lines.append(line.strip())
        child.send_signal(signal.SIGTERM)
        rest, _ = child.communicate(timeout=120)  # a hang guard only: it stops after its current engine step
    finally:
        if child.poll() is None:
            child.kill()
    lines += rest.split()
    assert child.returncode == 0
    report = json.loads(rest.strip().splitlines()[-1])
    printed = sum(line == "row" for line in lines)
    # Exactly the rows that finished before the stop are committed, in one part; the rest were in flight.
    assert report["committed"] == printed and 5 <= printed < ROWS
    assert report["in_flight"] == ROWS - printed and report["reason"] == "SIGTERM"
    folder = tmp_path / "out" / "checkpoints" / shard.shard_id
    assert sorted(p.name for p in folder.iterdir()) == [f"a001-p00001-n{printed}.commit",
                                                         f"a001-p00001-n{printed}.parquet"]
    assert _end_record(out, shard, 1)["reason"] == "SIGTERM"
    _resume_and_check(waves, shard, out, reference, printed)


@pytest.mark.parametrize("source", ["notice_file", "cancel_marker"])
def test_notice_file_and_cancel_marker_stop_the_shard(waves: LLMEngine, shard: Shard, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """The notice or the marker appears after the fifth row; the progress callback (in the engine's own thread)
    holds the engine until run_shard's StopSignal has seen it, so rows are in flight at the stop however fast the
    engine runs."""
    out = str(tmp_path / "out")
    notice = tmp_path / "spot-notice"
    monkeypatch.setenv(NOTICE_FILE_ENV, str(notice))
    monkeypatch.setenv(POLL_ENV, "0.05")
    signals: list[StopSignal] = []  # the StopSignal run_shard watches the environment with
    from_env = StopSignal.from_env

    def recorded(output_url: str | None = None, *, notices: bool = True) -> StopSignal:
        signals.append(from_env(output_url, notices=notices))
        return signals[-1]

    monkeypatch.setattr(StopSignal, "from_env", recorded)
    finished = [0]

    def progress(rows: int, tokens: int) -> None:
        finished[0] += rows
        if finished[0] >= 5:  # the null row and the first wave
            (notice if source == "notice_file" else tmp_path / "out" / "_CANCEL").touch()
            guard = time.monotonic() + HANG_GUARD_S
            while not signals[-1].is_set():  # is_set polls the file; the marker is watched from its thread
                assert time.monotonic() < guard, "the stop was never seen"
                time.sleep(0.01)

    with pytest.raises(ShardInterrupted) as stopped:
        run_shard(waves, shard, "question", out, shard_cfg(), progress=progress)
    assert 5 <= stopped.value.rows_committed == finished[0] < ROWS
    reason = _end_record(out, shard, 1)["reason"]
    assert ("notice file" in reason) if source == "notice_file" else ("cancelled" in reason)
    # While the notice or the marker is there, a new run commits and claims nothing.
    with pytest.raises(ShardInterrupted) as again:
        run_shard(waves, shard, "question", out, shard_cfg())
    # Its summary line is true: the rows not committed are left for the next attempt (before: "0 left").
    assert (again.value.rows_committed, again.value.rows_in_flight) == (stopped.value.rows_committed,
                                                                        ROWS - stopped.value.rows_committed)
    fs, root = output_fs(out)
    assert list_attempts(fs, root, shard.shard_id).latest == 1


def test_a_shard_cancelled_before_it_starts_says_all_its_rows_are_left(waves: LLMEngine, shard: Shard,
                                                                        tmp_path: Path) -> None:
    """A queued shard that meets the cancel marker (Ctrl-C's path) claims nothing and says so truly: 0 rows
    committed, all ROWS left for the next attempt (before: '0 rows committed, 0 left for the next attempt')."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "_CANCEL").touch()
    with pytest.raises(ShardInterrupted) as stopped:
        run_shard(waves, shard, "question", str(out), shard_cfg())
    assert (stopped.value.rows_committed, stopped.value.rows_in_flight) == (0, ROWS)
    assert f"0 rows committed, {ROWS} left for the next attempt" in str(stopped.value)
    assert not (out / "attempts").exists()


class _NoticeServer(BaseHTTPRequestHandler):
    answer: tuple[int, str] = (404, "")
    answered = 0  # GETs answered since the test last set it to 0

    def do_GET(self) -> None:  # http.server's name
        status, body = type(self).answer
        type(self).answered += 1
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def notice_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoticeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/latest/meta-data/spot/instance-action"
    server.shutdown()


def test_notice_url_200_means_stop_and_404_or_false_do_not(notice_url: str) -> None:
    for answer, stops in [((404, "Not Found"), False), ((200, "FALSE"), False),
                          ((200, '{"action": "terminate", "time": "2026-11-23T09:30:00Z"}'), True)]:
        _NoticeServer.answer, _NoticeServer.answered = answer, 0
        with StopSignal(notice_url=notice_url, poll_s=0.02) as stop:
            if stops:
                assert stop.wait(HANG_GUARD_S), answer  # polled from its thread
            guard = time.monotonic() + HANG_GUARD_S
            while not stops and _NoticeServer.answered < 2:  # asked again: the thread has read the first answer
                assert time.monotonic() < guard, "the notice URL was never polled twice"
                time.sleep(0.01)
            assert stop.is_set() is stops, answer
        assert stop.reason == (f"spot notice ({notice_url})" if stops else None)
    with StopSignal(notice_url="http://127.0.0.1:9/refused", poll_s=0.02) as unreachable:
        assert unreachable.wait(0.2) is False  # not on a cloud VM: no notice, no crash


def test_sigterm_handler_sets_the_flag_and_the_deadline_reads_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = StopSignal()
    previous = install_sigterm_handler(stop)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set() and stop.reason == "SIGTERM"  # and the test process is still alive
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop_deadline_s() == 20.0
    monkeypatch.setenv(DEADLINE_ENV, "7.5")
    assert stop_deadline_s() == 7.5
    monkeypatch.setenv(DEADLINE_ENV, "soon")
    with pytest.raises(ValueError, match=DEADLINE_ENV):
        stop_deadline_s()
    assert cancel_path("s3://bucket/out/") == "s3://bucket/out/_CANCEL"
    err = pickle.loads(pickle.dumps(ShardInterrupted(5, 11)))  # Dask ships it from worker to client
    assert (err.rows_committed, err.rows_in_flight) == (5, 11) and "5 rows committed" in str(err)
