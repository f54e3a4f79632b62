"""Attempt records: every run of a shard claims a number, and says how it ended when it can.

Layout under OUTPUT (JSON, create-only, never overwritten):

    attempts/<shard_id>/attempt-NNN.json      start: attempt, started_at (epoch seconds), host, pid, nonce
    attempts/<shard_id>/attempt-NNN.end.json  end:   attempt, outcome ("interrupted" | "failed"), rows_committed,
                                              gpu_s, ended_at, reason, error

A run claims the lowest free number with a create-only write, so two runs of one shard at once (a zombie worker and
its replacement) never share a number, and the numbers name their checkpoint parts. An attempt that finishes commits
the shard's accounting instead of an end record; one that is SIGKILLed leaves no end record (accounting estimates it).
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fsspec import AbstractFileSystem

from pipeline.storage import commit_json, list_folder, modified_at, read_json

Outcome = Literal["interrupted", "failed"]

_RECORD = re.compile(r"^attempt-(\d+)(\.end)?\.json$")


def attempts_dir(root: str, shard_id: str) -> str:
    """The folder of a shard's attempt records."""
    return f"{root}/attempts/{shard_id}"


def start_path(root: str, shard_id: str, attempt: int) -> str:
    """Where attempt `attempt` of the shard recorded its start."""
    return f"{attempts_dir(root, shard_id)}/attempt-{attempt:03d}.json"


def end_path(root: str, shard_id: str, attempt: int) -> str:
    """Where attempt `attempt` of the shard recorded how it ended (interrupted or failed)."""
    return f"{attempts_dir(root, shard_id)}/attempt-{attempt:03d}.end.json"


@dataclass(frozen=True)
class AttemptListing:
    """One listing of a shard's attempt records: attempt number -> last-modified time (epoch seconds, or None when
    the store does not say) of its start record and, for attempts that ended on their own, its end record."""

    started: dict[int, float | None]
    ended: dict[int, float | None]

    @property
    def latest(self) -> int:
        """The highest attempt number claimed (0 when none)."""
        return max(self.started, default=0)


def list_attempts(fs: AbstractFileSystem, root: str, shard_id: str) -> AttemptListing:
    """The shard's attempt records, from one fresh listing of its own folder."""
    started: dict[int, float | None] = {}
    ended: dict[int, float | None] = {}
    for info in list_folder(fs, attempts_dir(root, shard_id)):
        m = _RECORD.match(info["name"].rsplit("/", 1)[-1])
        if m:
            (ended if m.group(2) else started)[int(m.group(1))] = modified_at(info)
    return AttemptListing(started, ended)


def claim_attempt(fs: AbstractFileSystem, root: str, shard_id: str) -> tuple[int, float]:
    """Claim the shard's next attempt number with a create-only start record; returns (number, started_at epoch
    seconds). Tries numbers upward from one past the highest listed until a create succeeds. Raises what the store
    raises (after retry_transient's retries)."""
    attempt = list_attempts(fs, root, shard_id).latest + 1
    while True:
        record = {"attempt": attempt, "started_at": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                  "nonce": uuid.uuid4().hex}
        path = start_path(root, shard_id, attempt)
        if commit_json(fs, path, record) or read_record(fs, path).get("nonce") == record["nonce"]:
            # (the second test: our own write landed on an earlier try whose answer was lost)
            return attempt, record["started_at"]
        attempt += 1


def end_attempt(fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, outcome: Outcome, *,
                rows_committed: int, gpu_s: float, reason: str | None = None, error: str | None = None) -> None:
    """Record how attempt `attempt` ended: rows it committed (rows), device-seconds it held (seconds), why it stopped
    (`reason`) or what failed (`error`). Create-only; raises what the store raises."""
    commit_json(fs, end_path(root, shard_id, attempt), {
        "attempt": attempt, "outcome": outcome, "rows_committed": rows_committed, "gpu_s": gpu_s,
        "ended_at": time.time(), "reason": reason, "error": error})


def read_record(fs: AbstractFileSystem, path: str) -> dict[str, Any]:
    """An attempt record or checkpoint marker; {} when it is missing or cut short (a local write cut by a crash:
    create-only local writes claim the name atomically but do not write the content atomically)."""
    try:
        record = read_json(fs, path)
    except (FileNotFoundError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
