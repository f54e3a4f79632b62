"""Attempt records: every run of a shard claims a number, and says how it ended when it can.

Layout under OUTPUT (JSON, create-only, never overwritten; paths from pipeline.layout):

    attempts/<shard_id>/attempt-NNN.json      start: attempt, started_at (epoch seconds), host, pid, nonce,
                                              heartbeat_s, price_per_hour_usd (USD per device-hour it is billed
                                              at; absent in records of versions before it)
    attempts/<shard_id>/attempt-NNN.alive-MMMMMMMMMM-dDDDDDDDDDD.json
                                              a sign of life: the attempt was running MMMMMMMMMM ms after its start
                                              and had held DDDDDDDDDD device-ms (its share of the worker's engine;
                                              older versions wrote no -d part) (Heartbeat; written only when no
                                              checkpoint part showed it meanwhile)
    attempts/<shard_id>/attempt-NNN.end.json  end:   attempt, outcome ("interrupted" | "failed"), rows_committed,
                                              device_s, ended_at, reason, error
    attempts/<shard_id>/attempt-NNN.end-dDDDDDDDDDD.json
                                              end on a full disk: an empty file named by the device-ms the attempt
                                              held (end_on_full_disk; a full device still takes an empty file)

A run claims the lowest free number with a create-only write, so two runs of one shard at once (a zombie worker and
its replacement) never share a number, and the numbers name their checkpoint parts. An attempt that finishes commits
the shard's accounting instead of an end record; one that is SIGKILLed leaves no end record: accounting bills it from
its start to its last sign of life (its last checkpoint part or heartbeat, read from one listing by their names):
the device-seconds that sign says it held (its share of a shared engine), so the shards of one killed worker are
billed its time once. An attempt stopped by a full disk (its own commit, or the job stopping because another's
failed) records its device-seconds in the name of an empty file, which a full device still takes: the same bill as
an end record, and not a preemption.
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

from pipeline.layout import alive_path, attempts_dir, end_path, full_disk_end_path, parse_attempt_name, start_path
from pipeline.storage import commit_json, create_file, is_no_space, list_folder, modified_at, read_json

log = logging.getLogger(__name__)

Outcome = Literal["interrupted", "failed"]

@dataclass(frozen=True)
class AttemptListing:
    """One listing of a shard's attempt records: attempt number -> last-modified time (epoch seconds, or None when
    the store does not say) of its start record and, for attempts that ended on their own, its end record; `alive`:
    attempt number -> the latest heartbeat's seconds since that attempt's start, `alive_device_s`: -> the device-seconds
    it says the attempt held (heartbeats that say it), `full_disk`: attempt number -> device-seconds of an attempt
    that ended on a full disk (end_on_full_disk; it is in `ended` too). All from the names."""

    started: dict[int, float | None]
    ended: dict[int, float | None]
    alive: dict[int, float] = field(default_factory=dict)
    alive_device_s: dict[int, float] = field(default_factory=dict)
    full_disk: dict[int, float] = field(default_factory=dict)

    @property
    def latest(self) -> int:
        """The highest attempt number claimed (0 when none)."""
        return max(self.started, default=0)


def list_attempts(fs: AbstractFileSystem, root: str, shard_id: str) -> AttemptListing:
    """The shard's attempt records, from one fresh listing of its own folder."""
    listing = AttemptListing({}, {})
    for info in list_folder(fs, attempts_dir(root, shard_id)):
        name = parse_attempt_name(info["name"])
        if name is None:
            continue
        a = name.attempt
        if name.kind == "alive":
            listing.alive[a] = max(listing.alive.get(a, 0.0), name.elapsed_s or 0.0)
            if name.device_s is not None:
                listing.alive_device_s[a] = max(listing.alive_device_s.get(a, 0.0), name.device_s)
            continue
        (listing.ended if name.kind == "end" else listing.started)[a] = modified_at(info)
        if name.kind == "end" and name.device_s is not None:
            listing.full_disk[a] = name.device_s
    return listing


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


def end_on_full_disk(fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, device_s: float) -> None:
    """Record that attempt `attempt` ended on a full disk after holding `device_s` device-seconds: an empty file
    whose name says it (full_disk_end_path), which a device with no free data block still takes. Create-only;
    raises what the store raises (NoSpaceLeft too, when not even a name fits)."""
    create_file(fs, full_disk_end_path(root, shard_id, attempt, device_s), b"")


class Heartbeat:
    """While in its `with` block, a thread leaves signs of life of a running attempt: every `every_s` seconds in
    which nothing else showed the attempt alive (`last_sign()`, time.monotonic() of its last checkpoint commit), a
    create-only alive record (alive_path) named by the seconds since `started` (time.monotonic() of the attempt's
    start). So a killed attempt is billed up to its last sign of life, at the cost of at most one tiny write per
    `every_s` seconds without checkpoints. `device_s()` (optional): the device-seconds the attempt has held so far
    (its DeviceClock), said in the record's name too. A failed write is logged, never raised: the bill is the only
    loser."""

    def __init__(self, fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, *, every_s: float,
                 started: float, last_sign: Callable[[], float],
                 device_s: Callable[[], float] | None = None) -> None:
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0 seconds, got {every_s}")
        self.fs, self.root, self.shard_id, self.attempt = fs, root, shard_id, attempt
        self.every_s, self.started, self.last_sign, self.device_s = every_s, started, last_sign, device_s
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
                held = None if self.device_s is None else self.device_s()
                commit_json(self.fs, alive_path(self.root, self.shard_id, self.attempt, now - self.started, held),
                            {"attempt": self.attempt, "elapsed_s": now - self.started, "device_s": held,
                             "at": time.time()})
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
