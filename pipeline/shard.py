"""Run one shard: read its rows, generate (or embed: pipeline.row_kinds), checkpoint finished rows as they come, commit
results and accounting.

Layout under OUTPUT (every object create-only, never overwritten; paths from pipeline.layout):

    attempts/<shard_id>/attempt-NNN[.alive-M|.end].json  who ran the shard when, its signs of life, and how each run
                                                         ended (pipeline.attempts)
    checkpoints/<shard_id>/aNNN-pPPPPP-nROWS.parquet  finished rows, committed every few rows or seconds, each with a
    checkpoints/<shard_id>/aNNN-pPPPPP-nROWS.commit   commit marker (pipeline.checkpoint)
    results/<shard_id>.parquet                        the parts merged: one row per input row, in row order
    accounting/<shard_id>.attempt-NNN.parquet         the bill, committed last by the attempt that finished the shard

Every read and write of these goes through the shard's record (pipeline.record.ShardRecord and its Attempt).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from engine.loop.clock import DeviceClock
from pipeline.accounting import accounting_row
from pipeline.checkpoint import Checkpointer
from pipeline.config import RunConfig
from pipeline.images import image_rows, with_image_counts
from pipeline.input import InputChanged, Shard
from pipeline.preemption import StopSignal, stop_deadline_s
from pipeline.record import Attempt, ShardRecord
from pipeline.row_kinds import row_kind
from pipeline.shard_engine import EngineFacts, LazyEngine, NoDeviceClock, ShardRunner
from pipeline.shard_requests import ProgressFn, RowFn, RowRequests, generate_rows
from pipeline.shard_rows import ShardError, ShardRows, read_shard
from pipeline.storage import is_no_space

if TYPE_CHECKING:  # torch: imported where a shard runs (a worker), so the client that submits shards never loads it
    from engine import LLMEngine
    from engine.loop.engine_loop import EngineLoop

# The shard's rows (pipeline.shard_rows) and requests (pipeline.shard_requests), named here too for callers of the
# whole shard.
__all__ = ["ProgressFn", "RowFn", "ShardError", "ShardInterrupted", "ShardRows", "generate_rows", "read_shard",
           "run_shard"]

log = logging.getLogger(__name__)


class ShardInterrupted(RuntimeError):
    """The shard was told to stop (spot notice, SIGTERM, cancel) and committed its finished rows first.

    Attributes:
        rows_committed: rows of the shard committed so far, by every attempt (rows).
        rows_in_flight: rows of the shard left uncommitted, which the next attempt runs: those this attempt had
            taken on, or every uncommitted row when it stopped before starting (rows).
    Run the shard again (anywhere) to resume: only uncommitted rows are generated.
    """

    def __init__(self, rows_committed: int, rows_in_flight: int) -> None:
        super().__init__(rows_committed, rows_in_flight)  # args stay the constructor's: picklable across Dask
        self.rows_committed, self.rows_in_flight = rows_committed, rows_in_flight

    def __str__(self) -> str:
        return (f"shard stopped: {self.rows_committed} rows committed, {self.rows_in_flight} left for the next "
                "attempt; run it again to resume")


def run_shard(engine: LLMEngine | EngineLoop | LazyEngine, shard: Shard, prompt_column: str, output_url: str,
              cfg: RunConfig, *, progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
              watch_notices: bool = True, pinned: tuple[int, str] | None = None,
              model_fingerprint: str | None = None) -> dict[str, Any]:
    """Run one shard end to end under `output_url`, resuming from committed checkpoints; return its accounting row
    (schemas.ACCOUNTING_SCHEMA fields: tokens, seconds, USD). `engine`: the worker's resident engine loop
    (engine.loop.engine_loop.EngineLoop: the shard's rows share its batch with other shards running at the same time,
    and its device-seconds are its share of the steps plus the time the engine ran no step while it ran;
    DeviceClock, pipeline.accounting), an engine this caller holds alone (one `generate` call; billed its wall
    time), or a LazyEngine (pipeline.shard_engine), loaded only when a row is left to run: a shard whose rows are
    all error rows found before any engine (null, empty, a request error from the input, bad per-row sampling
    values) or all committed already finishes without it, billed 0 device-seconds, its rows and accounting naming
    the engine the job would have run (LazyEngine.facts).

    The shard's rows are read first; then, holding the engine, each run claims the shard's next attempt number (the
    engine's load and the read are not billed). Rows already in committed parts are not generated again; the
    others are, and every `cfg.checkpoint_rows` finished rows or `cfg.checkpoint_seconds` seconds (whichever first)
    they are committed as a part. When every row is committed the results (the parts merged in row order, one row
    per input row) are committed, then the accounting. A crash between any two commits loses at most one checkpoint
    interval; a rerun of a finished shard returns its committed accounting and writes nothing; when results are
    committed but not the accounting, the rerun only bills them. `progress` gets (rows, output tokens) for rows this
    run finishes (not rows resumed from checkpoints). `model_fingerprint` (pipeline.model_pin: the model `engine`
    loaded, which the caller checked against the job's pin; None when the job pinned none; a LazyEngine brings its
    own) goes into every row this run generates and into the accounting.

    Stopping: the engine polls `should_stop` (e.g. a StopSignal with install_sigterm_handler) and a StopSignal from
    the environment (notice file, notice URL, OUTPUT/_CANCEL; pipeline.preemption; watch_notices=False leaves the
    notice file and URL to `should_stop`, e.g. a Dask worker's own signal). Once either says stop, the
    finished rows are committed at once, retries bounded by TOKENMILL_STOP_DEADLINE_S seconds (default 20), an end
    record is written, and ShardInterrupted is raised.

    `pinned`: the input file's (size, version) as the job pinned it; the rows are read from exactly that version.

    Raises ShardError when the input cannot be read and InputChanged when it is no longer the pinned version (both
    after writing a failed-attempt record with the error), ShardInterrupted when stopped, what a LazyEngine's load
    raises (nothing recorded: its caller records it), and what the store raises when a commit fails after retries
    (NoSpaceLeft for a full local disk).
    """
    record = ShardRecord.open(output_url, shard.shard_id)
    if record.accounting is not None:
        return record.accounting
    with StopSignal.from_env(output_url, notices=watch_notices) as notice:
        if notice.check_now():  # cancelled or noticed before it started: claim nothing
            done = len(record.committed_rows())
            raise ShardInterrupted(done, max(0, shard.num_rows - done))
        work = None if record.results_committed else _ShardWork.read(record, shard, prompt_column, cfg, pinned)
        lazy = engine if isinstance(engine, LazyEngine) else LazyEngine.ready(engine, model_fingerprint)
        if lazy.loaded or (work is not None and work.requests.runnable):
            loaded, fingerprint = lazy.load()
            runner: ShardRunner | None = ShardRunner.of(loaded)
            facts = EngineFacts.of(runner.engine, fingerprint)
        else:
            runner, facts = None, lazy.facts()
        t0 = time.monotonic()
        clock = NoDeviceClock() if runner is None else DeviceClock(runner.idle)
        with clock:
            attempt = record.claim(cfg.heartbeat_seconds, cfg.price_per_hour_usd)
            try:
                return _run_attempt(runner, facts, work, shard, cfg, attempt, t0, clock, progress, notice,
                                    should_stop)
            except ShardInterrupted:
                raise
            except Exception as e:
                if is_no_space(e):  # not the shard's failure: the job stops (exit 6) and the rerun goes on
                    attempt.full_disk(clock.close())
                else:
                    attempt.fail(f"{type(e).__name__}: {e}", clock.close())
                raise


@dataclass(frozen=True)
class _ShardWork:
    """A shard's rows, those of them left to generate (`todo`: their positions, in order; `pending`: those rows,
    their images read into image prompts: pipeline.images), their requests (indices into `todo`:
    pipeline.shard_requests.row_requests) and the images of each (shard position -> images; empty for a job
    without images)."""

    rows: ShardRows
    todo: list[int]
    pending: ShardRows
    requests: RowRequests
    images: dict[int, int | None]

    @classmethod
    def read(cls, record: ShardRecord, shard: Shard, prompt_column: str, cfg: RunConfig,
             pinned: tuple[int, str] | None) -> _ShardWork:
        """Read the shard's rows (read_shard), its committed rows and the images of the others (image_rows). A read
        that fails (ShardError, InputChanged) is recorded as a failed attempt, then raised."""
        try:
            rows = read_shard(shard, prompt_column, cfg.id_column, pair_column=cfg.text_pair_column,
                              messages=prompt_column == cfg.messages_column != cfg.prompt_column, pinned=pinned,
                              image_column=cfg.image_column)
            done = record.committed_rows()
            todo = [k for k in range(len(rows.ids)) if k not in done]
            pending, counts = image_rows(rows.take(todo), shard.url, cfg.image_column, cfg.max_images_per_row)
        except (ShardError, InputChanged) as e:
            record.record_failure(f"{type(e).__name__}: {e}")
            raise
        images = {k: n for k, n in zip(todo, counts, strict=True)} if any(counts) else {}
        return cls(rows, todo, pending, row_kind(cfg).requests(pending, cfg), images)


def _results(merged: pa.Table, shard: Shard, schema: pa.Schema) -> pa.Table:
    """The shard's merged parts as `schema` (RESULTS_SCHEMA, or an embed job's): each row with its input file and
    its position in it."""
    rows = merged.num_rows
    table = merged.append_column("input_file", pa.array([shard.url] * rows, pa.string()))
    table = table.append_column("input_row", pc.add(merged.column("row"), pa.scalar(shard.row_start, pa.int64())))
    return table.select(schema.names).cast(schema)


def _run_attempt(loop: ShardRunner | None, facts: EngineFacts, work: _ShardWork | None, shard: Shard,
                 cfg: RunConfig, attempt: Attempt, t0: float, clock: DeviceClock, progress: ProgressFn | None,
                 notice: StopSignal, should_stop: Callable[[], bool] | None) -> dict[str, Any]:
    record, kind = attempt.record, row_kind(cfg)
    wall_s, generated_tokens = 0.0, 0
    if work is None:
        # An earlier attempt committed the results and died before the accounting: bill what is committed.
        results = record.results()
        kv = _kv_preemptions(record.merged(kind.part_schema))
        rows_resumed = results.num_rows
    else:
        rows, todo = work.rows, work.todo
        rows_resumed = len(rows.ids) - len(todo)
        ckpt = attempt.checkpointer(facts.model, every_rows=cfg.checkpoint_rows, every_s=cfg.checkpoint_seconds,
                                    started=t0, model_fingerprint=facts.model_fingerprint, device_s=clock.device_s,
                                    to_table=(with_image_counts(kind.part_table, work.images)
                                              if work.images and "images" in kind.part_schema.names
                                              else kind.part_table))

        def stop() -> bool:
            return notice.is_set() or (should_stop is not None and should_stop())

        t_gen = time.perf_counter()
        with attempt.heartbeat(every_s=cfg.heartbeat_seconds, started=t0, last_sign=lambda: ckpt.last_commit,
                               device_s=clock.device_s):
            outputs = kind.run(loop, work.pending, cfg, progress, on_row=lambda j, out: ckpt.add(todo[j], out),
                               should_stop=stop, clock=clock, requests=work.requests)
        wall_s = time.perf_counter() - t_gen
        aborted = sum(kind.aborted(o) for o in outputs)
        generated_tokens = sum(kind.output_tokens(o) for o in outputs if not kind.aborted(o))
        if aborted:
            owner = getattr(should_stop, "__self__", None)  # a StopSignal's is_set knows why it stopped
            reason = notice.reason or (owner.reason if isinstance(owner, StopSignal) else None) or "should_stop"
            _interrupted(attempt, ckpt, clock, rows_resumed, aborted, reason)
        ckpt.commit()
        record.refresh_parts()  # this attempt's parts, and any a racing attempt committed meanwhile
        merged = record.merged(kind.part_schema)
        if merged.column("row").to_pylist() != list(range(len(rows.ids))):
            raise RuntimeError(f"shard {shard.shard_id}: the committed parts under {record.checkpoints_dir}/ do not "
                               f"hold rows 0..{len(rows.ids) - 1} once each; were parts deleted while it ran?")
        kv = _kv_preemptions(merged)
        # a racing attempt's, if it committed first
        results = attempt.commit_results(_results(merged, shard, kind.results_schema))
    device_s = clock.close()  # this attempt's bill ends here: the engine's idle time is the other shards' from now
    row = accounting_row(
        shard_id=shard.shard_id, attempt=attempt.number, input_path=shard.url, row_start=shard.row_start,
        results=results, wall_s=wall_s, generated_tokens=generated_tokens, device_s=device_s,
        earlier=attempt.bill_earlier(cfg.checkpoint_seconds), rows_resumed=rows_resumed,
        kv_preemptions=kv, device=facts.device, dtype=facts.dtype,
        quantization=facts.quantization, model=facts.model, price_per_hour_usd=cfg.price_per_hour_usd,
        model_fingerprint=facts.model_fingerprint)
    attempt.finish(row)
    return row


def _kv_preemptions(merged: pa.Table) -> int:
    """Times the engine recomputed the merged rows' KV blocks (0 for an embed job's rows: no KV cache)."""
    if "kv_preemptions" not in merged.column_names:
        return 0
    return int(pc.sum(merged.column("kv_preemptions")).as_py() or 0)


def _interrupted(attempt: Attempt, ckpt: Checkpointer, clock: DeviceClock, rows_resumed: int, aborted: int,
                 reason: str) -> None:
    """Commit the finished rows within the stop deadline, record the interrupted attempt (or one stopped by a full
    disk: Attempt.full_disk), raise ShardInterrupted."""
    full = False
    try:
        ckpt.commit(deadline_s=stop_deadline_s())
    except Exception as e:  # report what is committed; the next attempt redoes the rest
        full = is_no_space(e)
        (log.debug if full else log.warning)("shard %s: could not commit %d finished rows before stopping: %s",
                                             attempt.record.shard_id, len(ckpt.pending), e)
    left = aborted + len(ckpt.pending)
    # Without the end record the next attempt estimates this one's time instead (Attempt.interrupt logs a failure).
    if full:
        attempt.full_disk(clock.close())
    else:
        attempt.interrupt(ckpt.rows_committed, clock.close(), reason)
    raise ShardInterrupted(rows_resumed + ckpt.rows_committed, left)
