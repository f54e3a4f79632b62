"""SIGINT (Ctrl-C), SIGHUP (a closed terminal) and SIGTERM to a real `tokenmill run` process mid-job, on real GSM8K
rows: the shards commit and stop, the lease is released, the message says what to do, the exit code is 130 / 129 /
143; the same command run again (no --resume, no wait for a lease to expire) finishes the job with every row exactly
once.

The runs use the tiny random-weight model (tests/jobs/conftest.py). Each interrupted run makes its own timing: its
worker loads hold_shard_preload.py (held_shard.preload_env), which holds the engine once the shard has finished a
row, and the signal goes out once the hold has begun: it always lands with rows left, however fast or loaded the
machine is."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from held_shard import held_pid, preload_env

from jobs.control import job_status
from jobs.lease import Lease

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 600.0
ROWS = 8  # three interrupted runs commit at least one row each and leave some
MAX_TOKENS = 16


@pytest.fixture()
def rows(tmp_path: Path, data_dir: Path) -> Path:
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(400, ROWS), path)
    return path


def _args(rows: Path, out: Path) -> list[str]:
    # One shard, one row at a time, each row committed as it finishes.
    return [sys.executable, "-m", "jobs.cli", "run", str(rows), str(out), "--prompt-column", "question",
            "--max-tokens", str(MAX_TOKENS), "--rows-per-shard", str(ROWS), "--checkpoint-rows", "1",
            "--max-num-seqs", "1", "--device", "cpu", "--json"]


def _interrupt(rows: Path, out: Path, env: dict[str, str], signum: int) -> str:
    """Start `tokenmill run`, its worker armed to hold the shard after its first finished row; send it `signum`
    once the hold has begun; return its stderr once it exited with 128 + signum and said how to go on."""
    # As from a terminal: every signal at its default disposition in the run (tests/conftest.py resets what the test
    # process inherited ignored).
    claim = out.parent / f"hold-claim-{signal.Signals(signum).name}"
    proc = subprocess.Popen(_args(rows, out),
                            env={**env, **preload_env(claim, after_rows=1)}, cwd=out.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        # Rows are being generated, and the shard cannot finish before the signal.
        held_pid(claim, lambda: proc.poll() is None)
        proc.send_signal(signum)
        proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join()
    stderr = "".join(lines)
    assert proc.returncode == 128 + signum, stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr and "Run the same command again" in stderr
    # No worker aborted at exit by a daemon thread still in torch (engine.loop.engine_loop's atexit hook, the plugin's
    # teardown): it used to print this as the cluster closed.
    assert "terminate called" not in stderr
    return stderr


def test_a_signal_to_the_client_stops_cleanly_and_a_rerun_resumes(rows: Path, tmp_path: Path) -> None:
    """SIGINT to a run, SIGHUP (a closed terminal) to the run that resumes it, SIGTERM to the next, then a fourth
    run finishes the job: each stop commits the finished rows, releases the lease and lifts its own cancel marker
    (the next run needs no --resume and no wait), and exits 128 + the signal's number."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENMILL_STOP_POLL_S="0.2")
    committed = 0
    for n, signum in enumerate((signal.SIGINT, signal.SIGHUP, signal.SIGTERM), start=1):
        _interrupt(rows, out, env, signum)
        st = job_status(str(out)).as_dict()  # what `tokenmill status --json` prints
        assert st["lease"] is None and st["cancelled"] is None and st["state"] != "running"
        assert st["shard_states"] and "running" not in st["shard_states"].values()
        assert committed < st["rows_committed"] < ROWS and st["attempts"] == n  # this run's finished rows kept
        committed = st["rows_committed"]

    again = subprocess.run(_args(rows, out), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S)
    assert again.returncode == 0, again.stderr
    assert "terminate called" not in again.stderr
    results = pq.read_table(out / "results")
    assert sorted(results.column("input_row").to_pylist()) == list(range(ROWS))


def test_a_lease_of_a_process_gone_from_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = str(tmp_path / "out")
    Lease(out, ttl_s=600, holder=f"{socket.gethostname()}:{dead.pid}:gone").acquire()  # never released
    with Lease(out, ttl_s=600) as lease:  # no LeaseHeld, no 600 s wait
        assert lease.seq == 1


def test_sigquit_is_taken_as_sigterm(rows: Path, tmp_path: Path) -> None:
    """SIGQUIT (Ctrl-\\) to a run drains it as SIGTERM does: finished rows committed, lease released, exit 131, no
    cancel marker left. Before: Python's default, exit 131 after only a `leaked semaphore` warning, nothing
    drained and the lease held."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENMILL_STOP_POLL_S="0.2")
    stderr = _interrupt(rows, out, env, signal.SIGQUIT)
    assert "leaked semaphore" not in stderr
    st = job_status(str(out)).as_dict()
    assert st["lease"] is None and st["cancelled"] is None and st["state"] == "incomplete"
    assert 0 < st["rows_committed"] < ROWS and st["attempts"] == 1
