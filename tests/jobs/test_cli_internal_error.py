"""An unexpected exception in a command (a bug) reaches the user as one line naming it and the file its traceback was
written to, with exit code 70: never a traceback on the terminal (jobs.cli._Cli, jobs.cli.output.internal_error)."""

from __future__ import annotations

from pathlib import Path

import pytest

import jobs.control
from jobs.cli import app
from jobs.errors import EXIT_INTERNAL


def test_a_bug_is_one_line_and_its_traceback_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    def buggy(output: str) -> None:
        raise KeyError("shards\nsecond line")

    monkeypatch.setattr(jobs.control, "job_status", buggy)
    monkeypatch.setenv("TOKENMILL_LOG_DIR", str(tmp_path))
    output = tmp_path / "job"
    output.mkdir()
    with pytest.raises(SystemExit) as exited:
        app(["status", str(output)], prog_name="tokenmill")
    assert exited.value.code == EXIT_INTERNAL
    captured = capsys.readouterr()
    stderr = captured.err.strip()
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    assert len(stderr.splitlines()) == 1, stderr
    logs = list(tmp_path.glob("tokenmill-error-*.log"))
    assert len(logs) == 1
    assert stderr.startswith("internal error: KeyError:") and "second line" in stderr and str(logs[0]) in stderr
    assert "tokenmill doctor" in stderr
    trace = logs[0].read_text()
    assert "Traceback (most recent call last)" in trace and "in buggy" in trace and "KeyError" in trace


def test_expected_errors_keep_their_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A JobError (no job at OUTPUT) is still its own line and code 2, not an internal error."""
    with pytest.raises(SystemExit) as exited:
        app(["status", str(tmp_path / "nothing-here")], prog_name="tokenmill")
    assert exited.value.code == 2
    assert "internal error" not in capsys.readouterr().err
