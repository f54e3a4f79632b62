"""Ctrl-C (SIGINT) and SIGTERM to `tokenmill run` / `submit`: stop the job cleanly instead of dying mid-commit.

The first signal takes the path of `tokenmill cancel`: it commits OUTPUT/_CANCEL, so running shards commit their
finished rows and stop, and queued ones do not start; the run then returns as a cancelled one, releasing its lease.
The client lifts its own cancel marker afterwards (jobs.control.resume_cancelled), so the same command run again
resumes without --resume. A second signal stops waiting at once (KeyboardInterrupt; the lease is still released).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from jobs.control import cancel_job, cancel_record, resume_cancelled
from jobs.errors import JobError
from pipeline.manifest import read_manifest

HANDLED = (signal.SIGINT, signal.SIGTERM)


class ClientInterrupt:
    """Context manager that turns SIGINT/SIGTERM into a cancel of the job at `output_url` (see the module docstring).

    Attributes:
        signum: the first signal received, or None.
        exit_code: 128 + signum (130 SIGINT, 143 SIGTERM), the shell's convention; 0 when no signal came.
    """

    def __init__(self, output_url: str) -> None:
        self.output_url = output_url
        self.signum: int | None = None
        self._reason = ""
        self._previous: dict[int, Any] = {}
        self._cancelled = threading.Event()

    @property
    def exit_code(self) -> int:
        return 0 if self.signum is None else 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None or read_manifest(self.output_url) is None:
            self.signum = self.signum or signum
            raise KeyboardInterrupt  # a second signal, or nothing started yet: stop at once
        self.signum = signum
        self._reason = f"{self.name} to tokenmill (pid {os.getpid()})"
        # Off the signal handler: it runs between bytecodes of the main thread, which may be inside the store.
        threading.Thread(target=self._cancel, name="tokenmill-interrupt", daemon=True).start()

    def _cancel(self) -> None:
        try:
            cancel_job(self.output_url, self._reason)
        except (JobError, OSError):
            pass  # the run ends on its own; the summary says what is committed
        finally:
            self._cancelled.set()

    def lift(self) -> None:
        """Remove the cancel marker this process committed (a cancel by `tokenmill cancel` stays)."""
        if self.signum is None:
            return
        self._cancelled.wait(30.0)
        record = cancel_record(self.output_url)
        if record is not None and record.get("reason") == self._reason:
            resume_cancelled(self.output_url)

    def __enter__(self) -> ClientInterrupt:
        if threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
