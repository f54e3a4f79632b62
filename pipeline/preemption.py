"""Stop signals: a spot notice, SIGTERM or `tokenmill cancel` tells a running shard to commit what it has and stop.

Sources, any of which sets a StopSignal:
- SIGTERM (Kubernetes, systemd, a spot fleet's drain) and SIGHUP (a closed terminal):
  `install_sigterm_handler(signal_obj)`, from the main thread.
- A notice file: env TOKENMILL_SPOT_NOTICE_FILE names a local path whose existence means stop (a preStop hook or
  a metadata watcher can touch it). Checked at most every 0.5 s.
- A notice URL: env TOKENMILL_SPOT_NOTICE_URL, e.g. AWS `http://169.254.169.254/latest/meta-data/spot/instance-action`
  (200 = stop, 404 = not; IMDSv2 tokens are fetched on a 401) or GCP
  `http://metadata.google.internal/computeMetadata/v1/instance/preempted` (200 with body TRUE = stop). Polled from a
  background thread every TOKENMILL_STOP_POLL_S seconds (default 5) with a 1 s timeout; unreachable = not.
- The cancel marker OUTPUT/_CANCEL (written by `tokenmill cancel`), polled like the URL, through fsspec.

The notice leaves 2 minutes on AWS, 30 s on GCP and none for a SIGKILL; TOKENMILL_STOP_DEADLINE_S (default 20 s) is
the budget run_shard gives the last checkpoint commit after a stop (pipeline.shard.run_shard).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import fsspec

from pipeline.layout import cancel_path
from pipeline.storage import exists_now
from schemas import settings

log = logging.getLogger(__name__)

NOTICE_FILE_ENV = settings.SPOT_NOTICE_FILE
NOTICE_URL_ENV = settings.SPOT_NOTICE_URL
POLL_ENV = settings.STOP_POLL_S
DEADLINE_ENV = settings.STOP_DEADLINE_S
FILE_POLL_S = 0.5


def stop_deadline_s() -> float:
    """Seconds run_shard may spend committing finished rows after a stop: env TOKENMILL_STOP_DEADLINE_S, default 20.
    Raises ValueError when the variable is not a positive number."""
    return settings.env_seconds(DEADLINE_ENV, 20.0)


class StopSignal:
    """A thread-safe stop flag that also watches a notice file, a notice URL and a cancel marker.

    `is_set()` is cheap (a flag, and a stat of the notice file at most every 0.5 s): the engine polls it before every
    step. The URL and the cancel marker are polled by a daemon thread, started by the first `is_set()` or `start()`
    and ended by `close()` (or the with block). Once set, it stays set; `reason` says which source set it first.
    """

    def __init__(self, *, notice_file: str | None = None, notice_url: str | None = None, cancel: str | None = None,
                 poll_s: float = 5.0, url_timeout_s: float = 1.0) -> None:
        """notice_file: local path; notice_url: http(s) URL; cancel: fsspec URL of a cancel marker; poll_s: seconds
        between polls of the URL and the marker; url_timeout_s: seconds one URL poll may take."""
        self.notice_file, self.notice_url, self.cancel = notice_file, notice_url, cancel
        self.poll_s, self.url_timeout_s = poll_s, url_timeout_s
        self.reason: str | None = None
        self._flag = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._next_file_check = 0.0
        self._imds_token: str | None = None

    @classmethod
    def from_env(cls, output_url: str | None = None, *, notices: bool = True) -> StopSignal:
        """Watch the env's notice file and URL (TOKENMILL_SPOT_NOTICE_FILE / _URL, polled every
        TOKENMILL_STOP_POLL_S seconds; not with notices=False, when another signal of this process watches them)
        and, given a job's OUTPUT, its cancel marker. Raises ValueError for a bad TOKENMILL_STOP_POLL_S."""
        return cls(notice_file=settings.env_text(NOTICE_FILE_ENV) if notices else None,
                   notice_url=settings.env_text(NOTICE_URL_ENV) if notices else None,
                   cancel=cancel_path(output_url) if output_url else None, poll_s=settings.env_seconds(POLL_ENV, 5.0))

    def set(self, reason: str = "stop") -> None:
        """Set the flag (first reason wins). Safe from signal handlers and other threads."""
        if not self._flag.is_set():
            self.reason = reason
            self._flag.set()

    def is_set(self) -> bool:
        """True once any source said stop."""
        if self._flag.is_set():
            return True
        if self._thread is None and (self.notice_url or self.cancel):
            self.start()
        if self.notice_file and time.monotonic() >= self._next_file_check:
            self._next_file_check = time.monotonic() + FILE_POLL_S
            self._poll_file()
        return self._flag.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the flag is set or `timeout_s` seconds pass; returns is_set() (the polling thread runs)."""
        self.is_set()
        return self._flag.wait(timeout_s)

    def check_now(self) -> bool:
        """Poll the notice file and the cancel marker now (not the URL, which may take its timeout); True if set."""
        self._poll_file()
        self._poll_cancel()
        return self._flag.is_set()

    def start(self) -> StopSignal:
        """Start the polling thread (idempotent)."""
        with self._lock:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="tokenmill-stop-signal", daemon=True)
                self._thread.start()
        return self

    def close(self) -> None:
        """Stop the polling thread; the flag keeps its value."""
        self._closed.set()

    def __enter__(self) -> StopSignal:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _run(self) -> None:
        while not self._flag.is_set():
            self._poll_cancel()
            self._poll_url()
            if self._closed.wait(self.poll_s):
                return

    def _poll_file(self) -> None:
        if self.notice_file and os.path.exists(self.notice_file):
            self.set(f"notice file {self.notice_file}")

    def _poll_cancel(self) -> None:
        if not self.cancel:
            return
        try:
            fs, path = fsspec.core.url_to_fs(self.cancel)
            if exists_now(fs, path):
                self.set(f"cancelled ({self.cancel})")
        except Exception as e:  # a store hiccup must not stop or crash the shard; poll again later
            log.warning("could not check the cancel marker %s: %s", self.cancel, e)

    def _poll_url(self) -> None:
        if not self.notice_url:
            return
        try:
            status, body = self._get(self.notice_url)
        except (OSError, ValueError) as e:  # unreachable (not on a cloud VM) or refused: no notice
            log.debug("spot notice URL %s: %s", self.notice_url, e)
            return
        # AWS answers 200 with {"action": ..., "time": ...} only once a notice exists; GCP always 200, TRUE/FALSE.
        if status == 200 and body.strip().upper() != "FALSE":
            self.set(f"spot notice ({self.notice_url})")

    def _get(self, url: str) -> tuple[int, str]:
        headers = {"Metadata-Flavor": "Google"}
        if self._imds_token:
            headers["X-aws-ec2-metadata-token"] = self._imds_token
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                        timeout=self.url_timeout_s) as r:
                return r.status, r.read(4096).decode(errors="replace")
        except urllib.error.HTTPError as e:
            if e.code == 401 and not self._imds_token:
                # AWS IMDSv2: GETs need a session token from a PUT to /latest/api/token.
                parts = urlsplit(url)
                req = urllib.request.Request(f"{parts.scheme}://{parts.netloc}/latest/api/token", method="PUT",
                                             headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
                with urllib.request.urlopen(req, timeout=self.url_timeout_s) as r:
                    self._imds_token = r.read().decode()
                return self._get(url)
            return e.code, ""


def install_sigterm_handler(stop: StopSignal) -> Any:
    """Make SIGTERM set `stop` (reason "SIGTERM"), and SIGHUP too (a closed terminal or a dying ssh session hangs up
    the whole process group: the shard commits its finished rows as on SIGTERM) unless SIGHUP is ignored (`nohup`),
    and SIGQUIT (Ctrl-\\, also sent to the whole foreground group) unless ignored; returns the previous SIGTERM
    handler.

    The handler only sets the flag: it neither exits nor chains to the previous handler, so the process lives on
    until run_shard has committed the finished rows and raised ShardInterrupted; the caller then exits (or restores
    the returned handler with signal.signal). Must be called from the main thread (Python's rule for signal
    handlers): raises ValueError otherwise.
    """
    def handler(signum: int, frame: Any) -> None:
        stop.set(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    for also in (signal.SIGHUP, signal.SIGQUIT):  # Ctrl-\ reaches the whole foreground process group, workers too
        if signal.getsignal(also) is not signal.SIG_IGN:
            signal.signal(also, handler)
    return previous
