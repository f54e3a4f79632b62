"""Attempt records: every run of a shard claims a number, and says how it ended when it can.

Layout under OUTPUT (JSON, create-only, never overwritten; paths from pipeline.layout):

    attempts/<shard_id>/attempt-NNN.json      start: attempt, started_at (epoch seconds), host, pid, nonce,
                                              heartbeat_s, price_per_hour_usd (USD per device-hour it is billed
                                              at; absent in records of versions before it)
    attempts/<shard_id>/attempt-NNN.alive-MMMMMMMMMM.json
                                              a sign of life: the attempt was running MMMMMMMMMM ms after its start
                                              (Heartbeat; written only when no checkpoint part showed it meanwhile)
    attempts/<shard_id>/attempt-NNN.end.json  end:   attempt, outcome ("interrupted" | "failed"), rows_committed,
                                              device_s, ended_at, reason, error

A run claims the lowest free number with a create-only write, so two runs of one shard at once (a zombie worker and
its replacement) never share a number, and the numbers name their checkpoint parts. An attempt that finishes commits
the shard's accounting instead of an end record; one that is SIGKILLed leaves no end record: accounting bills it from
its start to its last sign of life (its last checkpoint part or heartbeat, read from one listing by their names).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fsspec import AbstractFileSystem

from pipeline.layout import alive_path, attempts_dir, end_path, parse_attempt_record, start_path
from pipeline.storage import commit_json, is_no_space, list_folder, modified_at, read_json

log = logging.getLogger(__name__)

Outcome = Literal["interrupted", "failed"]

@dataclass(frozen=True)
class AttemptListing:
    """One listing of a shard's attempt records: attempt number -> last-modified time (epoch seconds, or None when
    the store does not say) of its start record and, for attempts that ended on their own, its end record; `alive`:
    attempt number -> the latest heartbeat's seconds since that attempt's start (from the names)."""

    started: dict[int, float | None]
    ended: dict[int, float | None]
    alive: dict[int, float] = field(default_factory=dict)

    @property
    def latest(self) -> int:
        """The highest attempt number claimed (0 when none)."""
        return max(self.started, default=0)


def list_attempts(fs: AbstractFileSystem, root: str, shard_id: str) -> AttemptListing:
    """The shard's attempt records, from one fresh listing of its own folder."""
    started: dict[int, float | None] = {}
    ended: dict[int, float | None] = {}
    alive: dict[int, float] = {}
    for info in list_folder(fs, attempts_dir(root, shard_id)):
        record = parse_attempt_record(info["name"])
        if record is None:
            continue
        attempt, kind, elapsed_s = record
        if elapsed_s is not None:
            alive[attempt] = max(alive.get(attempt, 0.0), elapsed_s)
        else:
            (ended if kind == "end" else started)[attempt] = modified_at(info)
    return AttemptListing(started, ended, alive)


def claim_attempt(fs: AbstractFileSystem, root: str, shard_id: str, heartbeat_s: float | None = None, *,
                  after: int | None = None, price_per_hour_usd: float | None = None) -> tuple[int, float]:
    """Claim the shard's next attempt number with a create-only start record; returns (number, started_at epoch
    seconds). `heartbeat_s`: the attempt leaves signs of life (Heartbeat) at this interval, seconds; None: it
    leaves none (a failed-attempt record; attempts of versions before heartbeats). `price_per_hour_usd`: the USD
    per device-hour its run bills (None: not recorded; a failed-attempt record that ran nothing). Tries numbers
    upward from one past `after` (the highest number a listing the caller holds shows; None: list the records now)
    until a create succeeds. Raises what the store raises (after retry_transient's retries)."""
    attempt = (list_attempts(fs, root, shard_id).latest if after is None else after) + 1
    while True:
        record = {"attempt": attempt, "started_at": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                  "nonce": uuid.uuid4().hex, "heartbeat_s": heartbeat_s, "price_per_hour_usd": price_per_hour_usd}
        path = start_path(root, shard_id, attempt)
        if commit_json(fs, path, record) or read_record(fs, path).get("nonce") == record["nonce"]:
            # (the second test: our own write landed on an earlier try whose answer was lost)
            return attempt, record["started_at"]
        attempt += 1


def end_attempt(fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, outcome: Outcome, *,
                rows_committed: int, device_s: float, reason: str | None = None, error: str | None = None) -> None:
    """Record how attempt `attempt` ended: rows it committed (rows), device-seconds it held (seconds), why it stopped
    (`reason`) or what failed (`error`). Create-only; raises what the store raises."""
    commit_json(fs, end_path(root, shard_id, attempt), {
        "attempt": attempt, "outcome": outcome, "rows_committed": rows_committed, "device_s": device_s,
        "ended_at": time.time(), "reason": reason, "error": error})


class Heartbeat:
    """While in its `with` block, a thread leaves signs of life of a running attempt: every `every_s` seconds in
    which nothing else showed the attempt alive (`last_sign()`, time.monotonic() of its last checkpoint commit), a
    create-only alive record (alive_path) named by the seconds since `started` (time.monotonic() of the attempt's
    start). So a killed attempt is billed up to its last sign of life, at the cost of at most one tiny write per
    `every_s` seconds without checkpoints. A failed write is logged, never raised: the bill is the only loser."""

    def __init__(self, fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, *, every_s: float,
                 started: float, last_sign: Callable[[], float]) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 seconds, got {every_s}")
        self.fs, self.root, self.shard_id, self.attempt = fs, root, shard_id, attempt
        self.every_s, self.started, self.last_sign = every_s, started, last_sign
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"tokenmill-heartbeat-{shard_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def _beat(self) -> None:
        last = self.started
        while not self.done.wait(max(0.0, self.every_s - (time.monotonic() - last))):
            now = time.monotonic()
            last = max(last, self.last_sign())
            if now - last < self.every_s:
                continue  # a checkpoint part showed the attempt alive meanwhile
            try:
                commit_json(self.fs, alive_path(self.root, self.shard_id, self.attempt, now - self.started),
                            {"attempt": self.attempt, "elapsed_s": now - self.started, "at": time.time()})
            except Exception as e:  # a missed heartbeat only shortens the bill of a killed attempt
                # (a full disk is said once, by the commit that fails next)
                (log.debug if is_no_space(e) else log.warning)(
                    "shard %s attempt %d: could not record a heartbeat: %s", self.shard_id, self.attempt, e)
            last = now


def read_record(fs: AbstractFileSystem, path: str) -> dict[str, Any]:
    """An attempt record or checkpoint marker; {} when it is missing, or (with a warning) cut short: local writes
    are atomic now (pipeline.storage), but a record of an older version may have been cut by a crash or a full disk.
    An unreadable record is skipped, never a lock."""
    try:
        record = read_json(fs, path)
    except FileNotFoundError:
        return {}
    except ValueError as e:
        log.warning("skipping the unreadable record %s: %s", path, e)
        return {}
    return record if isinstance(record, dict) else {}
