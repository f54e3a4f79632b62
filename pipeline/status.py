"""Where a shard stands, from its records under OUTPUT: a few listings and reads per shard, no input reads."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from pipeline.record import ShardRecord

State = Literal["done", "running", "partial", "failed", "pending"]

STALE_AFTER_S = 600.0


@dataclass(frozen=True)
class ShardState:
    """A shard's state.

    Attributes:
        shard_id: the shard.
        state: "done" (results and accounting committed), "running" (its latest attempt has no end record and was
            active, started or checkpointed, within `stale_after_s`), "failed" (its latest attempt failed; see
            last_error), "partial" (rows committed, nobody running: run the job again to resume), "pending" (nothing
            committed, nobody running).
        rows_committed: rows committed (the accounting's rows when done; else rows in committed checkpoint parts,
            from their names: a row two racing attempts both committed counts twice).
        attempts: attempts claimed (runs started).
        last_error: the error of the latest attempt when it failed, else None.
        accounting: the committed accounting row (schemas.ACCOUNTING_SCHEMA) when done, else None.
        last_activity: when the shard's records last changed (attempt records, markers, results), UTC; None when
            there are none.
    """

    shard_id: str
    state: State
    rows_committed: int
    attempts: int
    last_error: str | None
    accounting: dict[str, Any] | None
    last_activity: datetime | None


def _utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def shard_state(output_url: str, shard_id: str, *, stale_after_s: float = STALE_AFTER_S,
                now: float | None = None) -> ShardState:
    """The state of shard `shard_id` under `output_url` (see ShardState).

    An attempt counts as live while its latest activity is less than `stale_after_s` seconds (default 600) before
    `now` (epoch seconds, default the current time); a SIGKILLed worker's attempt turns stale after that long.
    Costs one ShardRecord snapshot (pipeline.record: one listing of attempts/<shard_id>/, one of
    checkpoints/<shard_id>/ for an unfinished shard, an exists check of the results) and one read for a finished or
    failed shard. Raises what the store raises.
    """
    record = ShardRecord.read(output_url, shard_id)
    now = time.time() if now is None else now
    attempts = record.attempts
    accounting = record.accounting
    if accounting is not None:
        return ShardState(shard_id, "done", int(accounting["rows"]), attempts.latest, None, accounting,
                          accounting["finished_at"])
    parts = record.parts
    latest = attempts.latest
    latest_times = [t for t in [attempts.started.get(latest), attempts.ended.get(latest)]
                    + [p.committed_at for p in parts if p.attempt == latest] if t is not None]
    times = [t for t in [*attempts.started.values(), *attempts.ended.values(), *(p.committed_at for p in parts)]
             if t is not None]
    rows = sum(p.rows for p in parts)
    if record.results_committed:  # results committed, accounting not yet (or a crash between)
        rows = record.results(columns=["id"]).num_rows
    last_activity = _utc(max(times, default=None))
    if latest in attempts.ended:
        end = record.end_record(latest)
        if end.get("outcome") == "failed":
            return ShardState(shard_id, "failed", rows, latest, end.get("error") or "failed", None, last_activity)
    live = bool(latest) and latest not in attempts.ended and bool(latest_times) and (
        now - max(latest_times) < stale_after_s)
    state: State = "running" if live else "partial" if rows else "pending"
    return ShardState(shard_id, state, rows, latest, None, None, last_activity)
