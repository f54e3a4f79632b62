"""infra/cron/tokenmill-cron.sh: flock -n keeps a second run of the same job from starting while the first runs; the
log and the exit code are tokenmill's. Real processes, a real small job.

The first run holds its lock for as long as the test says, not for as long as its job happens to take: its
`tokenmill` (a shim first on its PATH) waits for a line on its stdin, which the test sends once the second run has
been turned away, then runs the real `tokenmill`. So the second run always finds the lock held, on any machine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

WRAPPER = Path(__file__).resolve().parents[2] / "infra" / "cron" / "tokenmill-cron.sh"
WAIT_S = 600.0  # generous: a loaded CI box; the test never asserts on time


def _held_tokenmill(folder: Path) -> Path:
    """A folder whose `tokenmill` waits for a line on its stdin (inherited through the wrapper), then execs the real
    one (this venv's)."""
    folder.mkdir()
    shim = folder / "tokenmill"
    shim.write_text(f'#!/bin/sh\nread -r _ || true\nexec "{Path(sys.executable).parent / "tokenmill"}" "$@"\n')
    shim.chmod(0o755)
    return folder


def test_two_cron_runs_at_once_one_runs_the_other_skips(small_job: Path, tokenmill_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    env = dict(tokenmill_env, TOKENMILL_CRON_LOCK_DIR=str(tmp_path / "lock"), TOKENMILL_CRON_LOG_DIR=str(tmp_path))
    log = tmp_path / "job.log"
    out = tmp_path / "day-20260101"
    assert subprocess.run([str(WRAPPER), str(tmp_path / "missing.yaml")], env=env).returncode == 2

    held_env = dict(env, PATH=f"{_held_tokenmill(tmp_path / 'held')}:{env['PATH']}")
    first = subprocess.Popen([str(WRAPPER), str(small_job), "--output", str(out)], env=held_env,
                             stdin=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S  # the first run's start line: it holds the lock from before it
        while not (log.is_file() and "start:" in log.read_text()) and time.monotonic() < deadline:
            assert first.poll() is None, log.read_text() if log.is_file() else "the first run exited"
            time.sleep(0.05)
        second = subprocess.run([str(WRAPPER), str(small_job), "--output", str(out)], env=env, timeout=60)
        assert second.returncode == 3
        first.communicate("go\n", timeout=WAIT_S)  # the first run's tokenmill may start now
        assert first.returncode == 0, log.read_text()
    finally:
        if first.poll() is None:
            first.kill()
    lines = log.read_text().splitlines()
    assert sum("start:" in line for line in lines) == 1 and sum("skipped:" in line for line in lines) == 1
    assert lines[-1].endswith("exit 0")
    summary = json.loads(next(line for line in reversed(lines) if line.startswith('{"event": "summary"')))
    assert summary["rows_ok"] == 4 and summary["attempts"] == 2  # one attempt per shard: only the first run ran
    assert (out / "_SUCCESS").is_file() and not (tmp_path / "out").exists()
