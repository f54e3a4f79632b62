"""Ctrl-C (SIGINT), SIGTERM, SIGHUP (a closed terminal, a dying ssh session) and SIGQUIT (Ctrl-\\) to `tokenmill run`
/ `submit`: stop the job cleanly instead of dying mid-commit. A signal ignored when the run starts stays ignored
(SIGHUP under `nohup tokenmill run ...`; SIGINT and SIGQUIT in a script's background job, `tokenmill run ... &`).
SIGQUIT is taken as SIGTERM, not as Python's default (a core-dumping exit that drains nothing and leaves the lease
held): nobody sends it to get a half-committed job.

The first signal takes the path of `tokenmill cancel`: it commits OUTPUT/_CANCEL, so running shards commit their
finished rows and stop, and queued ones do not start; the run then returns as a cancelled one, releasing its lease.
The client lifts its own cancel marker afterwards (jobs.control.resume_cancelled), so the same command run again
resumes without --resume. A second signal stops waiting at once (KeyboardInterrupt; the lease is still released).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from jobs.control import cancel_job, cancel_record, resume_cancelled
from jobs.errors import JobError
from pipeline.manifest import read_manifest

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class ClientInterrupt:
    """Context manager that turns SIGINT/SIGTERM/SIGHUP/SIGQUIT into a cancel of the job at `output_url` (see the module
    docstring).

    Attributes:
        signum: the first signal received, or None.
        exit_code: 128 + signum (130 SIGINT, 143 SIGTERM, 129 SIGHUP, 131 SIGQUIT), the shell's convention; 0 when
            no signal
            came.
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
                if signal.getsignal(s) is not signal.SIG_IGN:  # nohup's SIGHUP, a background job's SIGINT, SIGQUIT
                    self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


T = TypeVar("T")


def run_or_exit_on_signal(fn: Callable[[], T], on_signal: Callable[[str], None]) -> T:
    """Run `fn` (work that writes nothing, e.g. a --dry-run forecast) in a thread and return what it returns (or raise
    what it raises); SIGINT, SIGTERM, SIGHUP or SIGQUIT exits the process at once with 128 + the signal's number, after
    `on_signal(signal name)` (one line for the user). The main thread only waits, so a signal is acted on within
    0.2 s however long a torch or store call in `fn` blocks: Python runs handlers on the main thread only."""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the main thread
            result["error"] = e

    def handle(signum: int, frame: FrameType | None) -> None:
        on_signal(signal.Signals(signum).name)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)  # NOTE: nothing to commit or release; the worker thread may be inside torch

    thread = threading.Thread(target=work, name="tokenmill-dry-run", daemon=True)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, handle) for s in HANDLED if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if "error" in result:
        raise result["error"]
    return result["value"]
