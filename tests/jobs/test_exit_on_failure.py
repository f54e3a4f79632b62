"""The commands' one way of ending on an error they expect (jobs.cli.output.exit_on_failure): a JobError and a
storage failure as one line and their exit codes, anything else passed on, the progress stopped first."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import typer

from jobs.cli.output import exit_on_failure
from jobs.errors import EXIT_LEASE_HELD, EXIT_NO_SPACE, JobError


def test_a_job_error_is_its_line_and_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    stopped = []
    with pytest.raises(typer.Exit) as exited, exit_on_failure("out/", {"device": "TOKENMILL_DEVICE"},
                                                              on_error=lambda: stopped.append(True)):
        raise JobError("held by another run; --device cuda is not here", EXIT_LEASE_HELD)
    assert exited.value.exit_code == EXIT_LEASE_HELD and stopped == [True]
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: held by another run") and "TOKENMILL_DEVICE" in line  # set_by named


def test_a_full_device_is_exit_6_naming_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as exited, exit_on_failure(str(tmp_path)):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert exited.value.exit_code == EXIT_NO_SPACE
    assert str(tmp_path) in capsys.readouterr().err


def test_other_errors_and_exits_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    stopped = []
    with pytest.raises(KeyError), exit_on_failure("out/", on_error=lambda: stopped.append(True)):
        raise KeyError("a bug")
    assert stopped == [True]  # the progress stops before the internal-error line too
    with pytest.raises(typer.Exit) as exited, exit_on_failure("out/", on_error=lambda: stopped.append(True)):
        raise typer.Exit(130)
    assert exited.value.exit_code == 130 and stopped == [True]  # a command's own exit: nothing to stop or print
    assert capsys.readouterr().err == ""
