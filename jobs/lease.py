"""The job lease: one run at a time per OUTPUT, on storage that can only create objects, never replace them.

Scheme. A lease is a sequence of small JSON records OUTPUT/_lease/<seq>.json (seq zero-padded, so names sort as
numbers), each {holder, seq, acquired_at, expires_at, released} with times in Unix seconds. The newest record
(highest seq) says who holds the job until when. To take the job, a run lists _lease/, reads the newest record and,
when it has expired or was released (or there is none), creates record seq + 1 with create-only semantics
(O_EXCL locally, If-None-Match: * on S3). Of two runs that race for the same seq, exactly one create succeeds; the
other reads the winner's record and exits with LeaseHeld. The holder renews from a background thread every ttl/3 by
creating the next record (seq + 1 again) with a later expiry, deletes its records older than the previous one (so
_lease/ stays small), and at the end creates a `released` record so the next run need not wait for the expiry.
If a renewal finds its next seq already taken, another run took the job over (ours had expired as that run saw
it): the lease is `lost` and the holder must stop starting work.

Race windows, honestly:
- Clocks. Expiry is judged on the contender's clock against the holder's: a contender whose clock runs more than
  ttl - ttl/3 ahead of the holder's can take over a live lease. Keep TTL well above the clock skew of the fleet
  (NTP keeps it to milliseconds; the default TTL is 60 s).
- Stalls. A holder that stalls longer than its TTL (a suspended VM, a partition from the store) loses the lease;
  until its next renewal attempt (at most ttl/3 later) it may still be running shards next to the new holder.
- So the lease is an efficiency guard, not what makes results correct: every object under OUTPUT is created once
  at a deterministic key, so two runs that overlap for a while commit the same shards once each and waste time,
  never data.
- Local records are written atomically (pipeline.storage), so no run leaves a short one; one that does not parse
  anyway (a record of an older version cut by a crash or a full disk) is skipped with a warning: it holds nothing,
  and the next claim goes above it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from jobs.errors import EXIT_LEASE_HELD, JobError
from pipeline.layout import lease_dir, lease_path, parse_lease_seq
from pipeline.storage import commit_json, list_folder, output_fs, read_json
from schemas import settings

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0
TTL_ENV = settings.LEASE_TTL_S


def default_ttl_s() -> float:
    """The lease TTL in seconds: $TOKENMILL_LEASE_TTL_S, else 60. Raises JobError (exit 2) for a bad value."""
    try:
        return settings.env_seconds(TTL_ENV, DEFAULT_TTL_S)
    except ValueError as e:
        raise JobError(str(e)) from None


@dataclass(frozen=True)
class LeaseRecord:
    """One record of the lease: `holder` holds the job until `expires_at` (Unix seconds), unless `released`."""

    holder: str
    seq: int
    acquired_at: float
    expires_at: float
    released: bool = False

    def active(self, now: float | None = None) -> bool:
        """True while the record still holds the job."""
        return not self.released and self.expires_at > (time.time() if now is None else now)

    def describe(self) -> str:
        """Who holds the lease and until when, for messages."""
        until = datetime.fromtimestamp(self.expires_at, UTC).isoformat(timespec="seconds")
        return f"{self.holder}, lease until {until} ({max(0.0, self.expires_at - time.time()):.0f} s from now)"


def holder_gone(holder: str) -> bool:
    """True when a lease holder (host:pid:random) is a process of this host that no longer exists: its lease can be
    taken over at once instead of after its expiry. False for other hosts (nothing to check there)."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


class LeaseHeld(JobError):
    """Another run holds the job's lease (exit code 3). `record` is its newest lease record."""

    def __init__(self, output_url: str, record: LeaseRecord) -> None:
        super().__init__(f"another run holds the job at {output_url}: {record.describe()}. Wait for it to finish "
                         "(`tokenmill status`), or, if it died, for the lease to expire and run again",
                         exit_code=EXIT_LEASE_HELD)
        self.record = record


def _listing(fs: AbstractFileSystem, root: str) -> dict[int, dict[str, Any]]:
    """seq -> the fsspec info of that record."""
    return {s: e for e in list_folder(fs, lease_dir(root)) if (s := parse_lease_seq(e["name"])) is not None}


def _read_record(fs: AbstractFileSystem, root: str, seq: int) -> LeaseRecord | None:
    """Record `seq`, or None (with a warning) when it does not parse: a record cut short by a full disk or a crash
    under an older version (writes are atomic now) holds nothing. Raises FileNotFoundError when it was deleted since
    the listing."""
    path = lease_path(root, seq)
    try:
        doc = read_json(fs, path)
        return LeaseRecord(str(doc["holder"]), int(doc["seq"]), float(doc["acquired_at"]), float(doc["expires_at"]),
                           bool(doc.get("released", False)))
    except (ValueError, KeyError, TypeError) as e:
        log.warning("skipping the unreadable lease record %s (%s: %s); it holds nothing", path, type(e).__name__, e)
        return None


def newest_record(output_url: str) -> LeaseRecord | None:
    """The newest readable lease record under OUTPUT (active or not), or None when no run ever took the lease."""
    fs, root = fsspec.core.url_to_fs(output_url)
    return _newest(fs, root)[0]


def _newest(fs: AbstractFileSystem, root: str) -> tuple[LeaseRecord | None, int]:
    """(the newest readable record or None, the highest seq listed or -1): unreadable records are skipped (with a
    warning), and the next record claimed must be above every listed one."""
    top = -1
    for _ in range(3):  # a record deleted between the listing and the read: list again
        listing = _listing(fs, root)
        if not listing:
            return None, -1
        top = max(listing)
        try:
            for seq in sorted(listing, reverse=True):
                if (record := _read_record(fs, root, seq)) is not None:
                    return record, top
        except FileNotFoundError:
            continue
        return None, top
    return None, top


class Lease:
    """This run's hold on OUTPUT (see the module docstring for the scheme and its race windows).

    Use as a context manager: entering acquires (raises LeaseHeld, exit code 3, when another run holds an
    unexpired lease) and starts the renewal thread; leaving stops it and releases the lease. `lost` is set when
    another run took the job over (this run's lease had expired as that run saw it).

    Args:
        output_url: the job's OUTPUT.
        ttl_s: seconds a record holds the job without renewal (default: default_ttl_s()).
        holder: this run's name (default host:pid:random).
    """

    def __init__(self, output_url: str, ttl_s: float | None = None, holder: str | None = None) -> None:
        self.output_url = output_url
        self.ttl_s = ttl_s if ttl_s is not None else default_ttl_s()
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.fs, self.root = output_fs(output_url)
        self.seq: int | None = None
        self.expires_at = 0.0
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _claim(self, seq: int, *, released: bool = False) -> LeaseRecord:
        """Create record `seq` for this holder; return the record now at `seq` (ours, or another holder's)."""
        now = time.time()
        mine = LeaseRecord(self.holder, seq, now, now if released else now + self.ttl_s, released)
        if commit_json(self.fs, lease_path(self.root, seq), asdict(mine)):
            return mine
        # Taken, by another run or by an earlier try of this very commit whose response was lost.
        try:
            taken = _read_record(self.fs, self.root, seq)
        except FileNotFoundError:
            return mine
        return taken or LeaseRecord("<unreadable lease record>", seq, now, now + self.ttl_s)

    def acquire(self) -> LeaseRecord:
        """Take the lease. Raises LeaseHeld when another run holds it (or wins the race for it)."""
        newest, top = _newest(self.fs, self.root)
        if newest is not None and newest.active() and newest.holder != self.holder and not holder_gone(newest.holder):
            raise LeaseHeld(self.output_url, newest)
        record = self._claim(top + 1)
        if record.holder != self.holder:
            raise LeaseHeld(self.output_url, record)
        self.seq, self.expires_at = record.seq, record.expires_at
        return record

    def renew(self) -> bool:
        """Extend the lease by ttl_s with the next record. Returns False (and sets `lost`) when another run took
        the job over. Transient storage errors propagate (the renewal thread tries again at its next tick)."""
        if self.seq is None or self.lost.is_set():
            return False
        record = self._claim(self.seq + 1)
        if record.holder != self.holder:
            self.lost.set()
            return False
        old, self.seq, self.expires_at = self.seq - 1, record.seq, record.expires_at
        if old >= 0:
            # Keep the previous record (a contender that listed a moment ago may be reading it); deleting older ones
            # is only tidiness, a leftover record is never the newest again.
            with contextlib.suppress(OSError):
                self.fs.rm_file(lease_path(self.root, old))
        return True

    def release(self) -> None:
        """Give the lease up now (a `released` record), unless it was lost. Errors are swallowed: an unreleased
        lease only makes the next run wait for the expiry."""
        if self.seq is None or self.lost.is_set():
            return
        with contextlib.suppress(OSError):
            self._claim(self.seq + 1, released=True)
        self.seq = None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    return
            except OSError:
                continue  # the store is having a bad moment; the next tick tries again, well before the expiry

    def __enter__(self) -> Lease:
        self.acquire()
        self._thread = threading.Thread(target=self._renew_loop, name="tokenmill-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.release()
