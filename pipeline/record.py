"""One owner of a shard's record under OUTPUT: what its attempts, checkpoint parts, results and accounting say, and
the writes of the attempt that runs it.

Its parts keep their roles: pipeline.layout spells the paths, pipeline.attempts the attempt records (claim, end,
heartbeat), pipeline.checkpoint the parts (list, merge, Checkpointer), pipeline.accounting the bill, pipeline.storage
the create-only commits. A ShardRecord is a snapshot: it lists `attempts/<shard_id>/` once and
`checkpoints/<shard_id>/` once (each when first asked, then kept; `refresh_parts` lists the parts again), so a shard
run, `tokenmill status`, the report and the OpenAI export each read a shard's records with one listing of each
folder. `claim` starts an attempt from the same listing: an Attempt, whose checkpointer, heartbeat and end records
(fail, interrupt) and final commits (results, then accounting: finish) go through it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import pyarrow as pa
from fsspec import AbstractFileSystem

from pipeline.accounting import EarlierAttempts, bill_earlier_attempts, committed_accounting_of, device_cost_usd
from pipeline.attempts import (
    AttemptListing,
    Heartbeat,
    claim_attempt,
    end_attempt,
    end_on_full_disk,
    list_attempts,
    read_record,
)
from pipeline.checkpoint import (
    Checkpointer,
    Part,
    PartTableFn,
    committed_parts,
    committed_rows,
    merge_parts,
    part_table,
)
from pipeline.layout import accounting_path, checkpoints_dir, end_path, results_path, start_path
from pipeline.storage import commit_table, exists_now, is_no_space, output_fs, read_fs, read_table
from schemas import ACCOUNTING_SCHEMA

log = logging.getLogger(__name__)


class ShardRecord:
    """A snapshot of shard `shard_id`'s records under the OUTPUT at `root` (protocol-less) on `fs`.

    Each property reads the store once, when first asked, and keeps what it read (a listing of a folder, an exists
    check): reading it twice costs nothing and gives the same answer. Raises what the store raises (after
    pipeline.storage's retries).
    """

    def __init__(self, fs: AbstractFileSystem, root: str, shard_id: str) -> None:
        self.fs, self.root, self.shard_id = fs, root, shard_id

    @classmethod
    def open(cls, output_url: str, shard_id: str) -> ShardRecord:
        """The record of a shard this process is about to write (creates OUTPUT's folder where folders exist)."""
        fs, root = output_fs(output_url)
        return cls(fs, root, shard_id)

    @classmethod
    def read(cls, output_url: str, shard_id: str) -> ShardRecord:
        """The record of a shard, to read only (creates nothing)."""
        fs, root = read_fs(output_url)
        return cls(fs, root, shard_id)

    @cached_property
    def attempts(self) -> AttemptListing:
        """The shard's attempt records: one listing of attempts/<shard_id>/ (pipeline.attempts.list_attempts)."""
        return list_attempts(self.fs, self.root, self.shard_id)

    @cached_property
    def parts(self) -> list[Part]:
        """The shard's committed checkpoint parts by (attempt, index): one listing of checkpoints/<shard_id>/."""
        return committed_parts(self.fs, self.root, self.shard_id)

    @property
    def checkpoints_dir(self) -> str:
        """The folder of the shard's checkpoint parts (protocol-less)."""
        return checkpoints_dir(self.root, self.shard_id)

    def refresh_parts(self) -> list[Part]:
        """List the committed parts again (parts this or a racing attempt committed since) and keep that listing."""
        self.__dict__.pop("parts", None)
        return self.parts

    @cached_property
    def results_committed(self) -> bool:
        """Whether the shard's results are committed (an exists check of results/<shard_id>.parquet)."""
        return exists_now(self.fs, results_path(self.root, self.shard_id))

    @cached_property
    def accounting(self) -> dict[str, Any] | None:
        """The accounting row (schemas.ACCOUNTING_SCHEMA, columns under their current names) of the attempt that
        finished the shard, when its results and accounting are committed; else None. Looks among the listed
        attempts, latest first."""
        if not self.results_committed:
            return None
        return committed_accounting_of(self.fs, self.root, self.shard_id, self.attempts.started)

    def committed_rows(self) -> set[int]:
        """Positions (in the shard) of the rows in the listed committed parts (reads their `row` column only)."""
        return committed_rows(self.fs, self.parts)

    def bill_unfinished(self, checkpoint_seconds: float, now: float | None = None) -> EarlierAttempts:
        """What every attempt of a shard with no accounting (failed, stopped, killed, or still running) has cost so
        far, in device-seconds: bill_earlier_attempts over all its listed attempts, `now` (epoch seconds, default
        the current time) bounding a latest attempt killed before its first sign of life. A job's summary adds it
        for failed shards and `tokenmill status` / `report` for unfinished ones, so time no commit kept is still
        on the bill."""
        return bill_earlier_attempts(self.fs, self.root, self.shard_id, self.attempts.latest + 1, self.attempts,
                                     self.parts, checkpoint_seconds, time.time() if now is None else now)

    def unfinished_bill(self, checkpoint_seconds: float, price_per_hour_usd: float,
                        now: float | None = None) -> tuple[float, float]:
        """(device-seconds, USD) of the attempts of a shard with no accounting (bill_unfinished), billed at the price
        its latest attempt's run recorded in its start record, else at `price_per_hour_usd` (USD per device-hour;
        attempts claimed before the price was recorded). The one bill of a failed shard: a run's summary
        (jobs.cluster.fail_shard) and `tokenmill status` both take it from here."""
        bill = self.bill_unfinished(checkpoint_seconds, now)
        price = self.start_record(self.attempts.latest).get("price_per_hour_usd") if self.attempts.latest else None
        return bill.device_s, device_cost_usd(bill.device_s, price_per_hour_usd if price is None else float(price))

    def merged(self, schema: pa.Schema | None = None) -> pa.Table:
        """The listed parts' rows in row order, one per position, as `schema` (None: schemas.CHECKPOINT_PART_SCHEMA,
        a generate job's; an embed job's: schemas.arrow.embed_part_schema)."""
        return merge_parts(self.fs, self.parts) if schema is None else merge_parts(self.fs, self.parts, schema)

    def read_part(self, part: Part) -> pa.Table:
        """One committed part as written (the columns of the version that wrote it)."""
        return read_table(self.fs, part.path)

    def results(self, columns: list[str] | None = None) -> pa.Table:
        """The committed results (schemas.RESULTS_SCHEMA), or only `columns` of them. Raises FileNotFoundError when
        none are committed."""
        return read_table(self.fs, results_path(self.root, self.shard_id), columns=columns)

    def start_record(self, attempt: int) -> dict[str, Any]:
        """Attempt `attempt`'s start record ({} when missing or unreadable; pipeline.attempts.read_record)."""
        return read_record(self.fs, start_path(self.root, self.shard_id, attempt))

    def end_record(self, attempt: int) -> dict[str, Any]:
        """Attempt `attempt`'s end record ({} when it has none: running, finished or killed)."""
        return read_record(self.fs, end_path(self.root, self.shard_id, attempt))

    def claim(self, heartbeat_s: float | None = None, price_per_hour_usd: float | None = None) -> Attempt:
        """Claim the shard's next attempt number (pipeline.attempts.claim_attempt, from this snapshot's listing:
        no second listing). `heartbeat_s`: the interval of the attempt's signs of life, seconds (None: it leaves
        none). `price_per_hour_usd`: the USD per device-hour the run bills, kept in the start record (None: not
        recorded). Numbers another run took between the listing and the claim join the snapshot as started, as does
        the claimed one, so the bill sees every attempt before it."""
        listing = self.attempts
        number, started_at = claim_attempt(self.fs, self.root, self.shard_id, heartbeat_s, after=listing.latest,
                                            price_per_hour_usd=price_per_hour_usd)
        taken = dict.fromkeys(range(listing.latest + 1, number)) | {number: started_at}
        self.attempts = replace(listing, started={**listing.started, **taken})
        return Attempt(self, number, started_at)

    def record_failure(self, error: str) -> int:
        """Record a failed attempt of a shard that never ran (so `tokenmill status` shows it failed, with `error`);
        returns its number. Raises what the store raises."""
        attempt = self.claim()
        end_attempt(self.fs, self.root, self.shard_id, attempt.number, "failed", rows_committed=0, device_s=0.0,
                    error=error)
        return attempt.number


@dataclass(frozen=True)
class Attempt:
    """A claimed attempt of the shard of `record`: `number`, started at `started_at` (epoch seconds). Its writes all
    go under the shard's record: checkpoint parts (checkpointer), signs of life (heartbeat), the end record of an
    attempt that stops (interrupt) or fails (fail), and, for the attempt that finishes the shard, the results
    (commit_results) and then the accounting (finish)."""

    record: ShardRecord
    number: int
    started_at: float

    def checkpointer(self, model: str, *, every_rows: int, every_s: float, started: float,
                     model_fingerprint: str | None = None, device_s: Any = None,
                     to_table: PartTableFn = part_table) -> Checkpointer:
        """A Checkpointer for this attempt's finished rows (pipeline.checkpoint.Checkpointer: `every_rows` rows or
        `every_s` seconds; `started`: the attempt's start on time.monotonic(); `device_s()`: the device-seconds the
        attempt has held so far, said in each marker; `to_table`: how its parts are built)."""
        r = self.record
        return Checkpointer(r.fs, r.root, r.shard_id, self.number, model, every_rows=every_rows, every_s=every_s,
                            started=started, model_fingerprint=model_fingerprint, device_s=device_s,
                            to_table=to_table)

    def heartbeat(self, *, every_s: float, started: float, last_sign: Any, device_s: Any = None) -> Heartbeat:
        """This attempt's Heartbeat (pipeline.attempts.Heartbeat: a `with` block; `every_s` seconds; `started` on
        time.monotonic(); `last_sign()`: time.monotonic() of its last checkpoint commit; `device_s()`: the
        device-seconds the attempt has held so far)."""
        r = self.record
        return Heartbeat(r.fs, r.root, r.shard_id, self.number, every_s=every_s, started=started,
                         last_sign=last_sign, device_s=device_s)

    def fail(self, error: str, device_s: float) -> None:
        """Record that this attempt failed with `error` after `device_s` device-seconds. A write that fails is
        logged, never raised (a full disk: recorded as full_disk instead): the shard's own error is the one its
        caller raises."""
        self._end("failed", rows_committed=0, device_s=device_s, error=error)

    def interrupt(self, rows_committed: int, device_s: float, reason: str) -> None:
        """Record that this attempt stopped for `reason` after committing `rows_committed` rows, holding the
        device `device_s` seconds. Logged, never raised, when the write fails (the next attempt then bills this
        one as killed; a full disk: recorded as full_disk instead)."""
        self._end("interrupted", rows_committed=rows_committed, device_s=device_s, reason=reason)

    def full_disk(self, device_s: float) -> None:
        """Record that this attempt ended on a full disk after `device_s` device-seconds (an empty file whose name
        says it: pipeline.attempts.end_on_full_disk): billed as an end record, not counted as a preemption or a
        failure. Logged, never raised, when even that fails."""
        r = self.record
        try:
            end_on_full_disk(r.fs, r.root, r.shard_id, self.number, device_s)
        except Exception as e:  # the job's own line says the disk is full
            log.warning("shard %s: could not record attempt %d stopped by a full disk: %s", r.shard_id, self.number,
                        e)

    def _end(self, outcome: Any, **fields: Any) -> None:
        r = self.record
        try:
            end_attempt(r.fs, r.root, r.shard_id, self.number, outcome, **fields)
        except Exception as e:  # the caller's own error or stop is what matters
            if is_no_space(e):  # the record needs a data block; a name needs none: its bill survives the full disk
                self.full_disk(fields["device_s"])
                return
            log.warning("shard %s: could not record %s attempt %d: %s", r.shard_id, outcome, self.number, e)

    def commit_results(self, results: pa.Table) -> pa.Table:
        """Commit the shard's results (schemas.RESULTS_SCHEMA); returns what readers see: `results`, or those a
        racing attempt committed first. Raises what the store raises."""
        r = self.record
        if commit_table(r.fs, results_path(r.root, r.shard_id), results):
            return results
        return r.results()

    def bill_earlier(self, checkpoint_seconds: float) -> EarlierAttempts:
        """What the attempts before this one cost (pipeline.accounting.bill_earlier_attempts), from the record's
        attempt listing and its latest parts listing."""
        r = self.record
        return bill_earlier_attempts(r.fs, r.root, r.shard_id, self.number, r.attempts, r.parts, checkpoint_seconds)

    def finish(self, accounting: dict[str, Any]) -> None:
        """Commit this attempt's accounting row (schemas.ACCOUNTING_SCHEMA), the shard's last record: after it the
        shard is done. Raises what the store raises."""
        r = self.record
        commit_table(r.fs, accounting_path(r.root, r.shard_id, self.number),
                     pa.Table.from_pylist([accounting], schema=ACCOUNTING_SCHEMA))
