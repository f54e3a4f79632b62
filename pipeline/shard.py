"""Run one shard: read its rows, generate, checkpoint finished rows as they come, commit results and accounting.

Layout under OUTPUT (every object create-only, never overwritten; paths from pipeline.layout):

    attempts/<shard_id>/attempt-NNN[.alive-M|.end].json  who ran the shard when, its signs of life, and how each run
                                                         ended (pipeline.attempts)
    checkpoints/<shard_id>/aNNN-pPPPPP-nROWS.parquet  finished rows, committed every few rows or seconds, each with a
    checkpoints/<shard_id>/aNNN-pPPPPP-nROWS.commit   commit marker (pipeline.checkpoint)
    results/<shard_id>.parquet                        the parts merged: one row per input row, in row order
    accounting/<shard_id>.attempt-NNN.parquet         the bill, committed last by the attempt that finished the shard
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from fsspec import AbstractFileSystem

from engine.loop.submission import DeviceClock
from pipeline.accounting import accounting_row, bill_earlier_attempts, quantization_label, read_committed_accounting
from pipeline.attempts import Heartbeat, claim_attempt, end_attempt, list_attempts
from pipeline.checkpoint import Checkpointer, committed_parts, committed_rows, completion_tokens, merge_parts
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.layout import accounting_path, checkpoints_dir, results_path
from pipeline.preemption import StopSignal, stop_deadline_s
from pipeline.shard_requests import ProgressFn, RowFn, generate_rows
from pipeline.shard_rows import ShardError, ShardRows, read_shard
from pipeline.storage import commit_table, exists_now, is_no_space, output_fs, read_table
from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA

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
        rows_in_flight: rows this attempt had taken on and left uncommitted; the next attempt runs them (rows).
    Run the shard again (anywhere) to resume: only uncommitted rows are generated.
    """

    def __init__(self, rows_committed: int, rows_in_flight: int) -> None:
        super().__init__(rows_committed, rows_in_flight)  # args stay the constructor's: picklable across Dask
        self.rows_committed, self.rows_in_flight = rows_committed, rows_in_flight

    def __str__(self) -> str:
        return (f"shard stopped: {self.rows_committed} rows committed, {self.rows_in_flight} left for the next "
                "attempt; run it again to resume")


def run_shard(engine: LLMEngine | EngineLoop, shard: Shard, prompt_column: str, output_url: str, cfg: RunConfig, *,
              progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
              watch_notices: bool = True, pinned: tuple[int, str] | None = None,
              model_fingerprint: str | None = None) -> dict[str, Any]:
    """Run one shard end to end under `output_url`, resuming from committed checkpoints; return its accounting row
    (schemas.ACCOUNTING_SCHEMA fields: tokens, seconds, USD). `engine`: the worker's resident engine loop
    (engine.loop.engine_loop.EngineLoop: the shard's rows share its batch with other shards running at the same time,
    and its device-seconds are its share of the steps plus the time the engine ran no step while it ran;
    DeviceClock, pipeline.accounting), or an engine this caller holds alone (one `generate` call; billed its wall
    time).

    Each run claims the shard's next attempt number. Rows already in committed parts are not generated again; the
    others are, and every `cfg.checkpoint_rows` finished rows or `cfg.checkpoint_seconds` seconds (whichever first)
    they are committed as a part. When every row is committed the results (the parts merged in row order, one row
    per input row) are committed, then the accounting. A crash between any two commits loses at most one checkpoint
    interval; a rerun of a finished shard returns its committed accounting and writes nothing; when results are
    committed but not the accounting, the rerun only bills them. `progress` gets (rows, output tokens) for rows this
    run finishes (not rows resumed from checkpoints). `model_fingerprint` (pipeline.model_pin: the model `engine`
    loaded, which the caller checked against the job's pin; None when the job pinned none) goes into every row this
    run generates and into the accounting.

    Stopping: the engine polls `should_stop` (e.g. a StopSignal with install_sigterm_handler) and a StopSignal from
    the environment (notice file, notice URL, OUTPUT/_CANCEL; pipeline.preemption; watch_notices=False leaves the
    notice file and URL to `should_stop`, e.g. a Dask worker's own signal). Once either says stop, the
    finished rows are committed at once, retries bounded by TOKENMILL_STOP_DEADLINE_S seconds (default 20), an end
    record is written, and ShardInterrupted is raised.

    `pinned`: the input file's (size, version) as the job pinned it; the rows are read from exactly that version.

    Raises ShardError when the input cannot be read and InputChanged when it is no longer the pinned version (both
    after writing a failed-attempt record with the error), ShardInterrupted when stopped, and what the store raises
    when a commit fails after retries (NoSpaceLeft for a full local disk).
    """
    from engine.loop.engine_loop import EngineLoop

    fs, root = output_fs(output_url)
    committed = read_committed_accounting(fs, root, shard.shard_id)
    if committed is not None:
        return committed
    with StopSignal.from_env(output_url, notices=watch_notices) as notice:
        if notice.check_now():  # cancelled or noticed before it started: claim nothing
            raise ShardInterrupted(len(committed_rows(fs, committed_parts(fs, root, shard.shard_id))), 0)
        t0 = time.monotonic()
        with DeviceClock(engine if isinstance(engine, EngineLoop) else None) as clock:
            attempt, _ = claim_attempt(fs, root, shard.shard_id, cfg.heartbeat_seconds)
            try:
                return _run_attempt(engine, shard, prompt_column, fs, root, cfg, attempt, t0, clock, progress,
                                    notice, should_stop, pinned, model_fingerprint)
            except ShardInterrupted:
                raise
            except Exception as e:
                try:
                    end_attempt(fs, root, shard.shard_id, attempt, "failed", rows_committed=0,
                                device_s=clock.close(), error=f"{type(e).__name__}: {e}")
                except Exception as record_error:  # the shard's own error is the one to raise (a full disk: once)
                    (log.debug if is_no_space(record_error) else log.warning)(
                        "shard %s: could not record failed attempt %d: %s", shard.shard_id, attempt, record_error)
                raise


def _results(merged: pa.Table, shard: Shard) -> pa.Table:
    """The shard's merged parts as RESULTS_SCHEMA: each row with its input file and its position in it."""
    rows = merged.num_rows
    table = merged.append_column("input_file", pa.array([shard.url] * rows, pa.string()))
    table = table.append_column("input_row", pc.add(merged.column("row"), pa.scalar(shard.row_start, pa.int64())))
    return table.select(RESULTS_SCHEMA.names).cast(RESULTS_SCHEMA)


def _run_attempt(engine: LLMEngine | EngineLoop, shard: Shard, prompt_column: str, fs: AbstractFileSystem, root: str,
                 cfg: RunConfig, attempt: int, t0: float, clock: DeviceClock, progress: ProgressFn | None,
                 notice: StopSignal, should_stop: Callable[[], bool] | None, pinned: tuple[int, str] | None = None,
                 model_fingerprint: str | None = None) -> dict[str, Any]:
    from engine.loop.engine_loop import EngineLoop

    loop = engine
    engine = loop.engine if isinstance(loop, EngineLoop) else loop
    done_path = results_path(root, shard.shard_id)
    wall_s, generated_tokens = 0.0, 0
    if exists_now(fs, done_path):
        # An earlier attempt committed the results and died before the accounting: bill what is committed.
        results = read_table(fs, done_path)
        parts = committed_parts(fs, root, shard.shard_id)
        kv = merge_parts(fs, parts).column("kv_preemptions")
        rows_resumed = results.num_rows
    else:
        rows = read_shard(shard, prompt_column, cfg.id_column,
                          messages=prompt_column == cfg.messages_column != cfg.prompt_column, pinned=pinned)
        done = committed_rows(fs, committed_parts(fs, root, shard.shard_id))
        todo = [k for k in range(len(rows.ids)) if k not in done]
        rows_resumed = len(rows.ids) - len(todo)
        ckpt = Checkpointer(fs, root, shard.shard_id, attempt, engine.model_name, every_rows=cfg.checkpoint_rows,
                            every_s=cfg.checkpoint_seconds, started=t0, model_fingerprint=model_fingerprint)

        def stop() -> bool:
            return notice.is_set() or (should_stop is not None and should_stop())

        t_gen = time.perf_counter()
        with Heartbeat(fs, root, shard.shard_id, attempt, every_s=cfg.heartbeat_seconds, started=t0,
                       last_sign=lambda: ckpt.last_commit):
            outputs = generate_rows(loop, rows.take(todo), cfg, progress,
                                    on_row=lambda j, out: ckpt.add(todo[j], out), should_stop=stop, clock=clock)
        wall_s = time.perf_counter() - t_gen
        generated_tokens = sum(completion_tokens(o) for o in outputs)
        aborted = sum(o.finish_reason == "abort" for o in outputs)
        if aborted:
            owner = getattr(should_stop, "__self__", None)  # a StopSignal's is_set knows why it stopped
            reason = notice.reason or (owner.reason if isinstance(owner, StopSignal) else None) or "should_stop"
            _interrupted(fs, root, shard.shard_id, attempt, ckpt, clock, rows_resumed, aborted, reason)
        ckpt.commit()
        parts = committed_parts(fs, root, shard.shard_id)
        merged = merge_parts(fs, parts)
        if merged.column("row").to_pylist() != list(range(len(rows.ids))):
            raise RuntimeError(f"shard {shard.shard_id}: the committed parts under "
                               f"{checkpoints_dir(root, shard.shard_id)}/ do not hold rows 0..{len(rows.ids) - 1} "
                               "once each; were parts deleted while it ran?")
        kv = merged.column("kv_preemptions")
        results = _results(merged, shard)
        if not commit_table(fs, done_path, results):
            results = read_table(fs, done_path)  # a racing attempt committed first: bill what readers see
    device_s = clock.close()  # this attempt's bill ends here: the engine's idle time is the other shards' from now
    earlier = bill_earlier_attempts(fs, root, shard.shard_id, attempt, list_attempts(fs, root, shard.shard_id),
                                    parts, cfg.checkpoint_seconds)
    row = accounting_row(
        shard_id=shard.shard_id, attempt=attempt, input_path=shard.url, row_start=shard.row_start, results=results,
        wall_s=wall_s, generated_tokens=generated_tokens, device_s=device_s, earlier=earlier, rows_resumed=rows_resumed,
        kv_preemptions=int(pc.sum(kv).as_py() or 0), device=engine.device_name,
        dtype=str(engine.dtype).removeprefix("torch."),
        quantization=quantization_label(engine.config.quantization, getattr(engine, "quantization_loaded", None)),
        model=engine.model_name, price_per_hour_usd=cfg.price_per_hour_usd, model_fingerprint=model_fingerprint)
    commit_table(fs, accounting_path(root, shard.shard_id, attempt), pa.Table.from_pylist([row],
                                                                                         schema=ACCOUNTING_SCHEMA))
    return row


def _interrupted(fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, ckpt: Checkpointer, clock: DeviceClock,
                 rows_resumed: int, aborted: int, reason: str) -> None:
    """Commit the finished rows within the stop deadline, record the interrupted attempt, raise ShardInterrupted."""
    try:
        ckpt.commit(deadline_s=stop_deadline_s())
    except Exception as e:  # report what is committed; the next attempt redoes the rest
        log.warning("shard %s: could not commit %d finished rows before stopping: %s", shard_id, len(ckpt.pending), e)
    left = aborted + len(ckpt.pending)
    try:
        end_attempt(fs, root, shard_id, attempt, "interrupted", rows_committed=ckpt.rows_committed,
                    device_s=clock.close(), reason=reason)
    except Exception as e:  # without it the next attempt estimates this one's time instead
        (log.debug if is_no_space(e) else log.warning)("shard %s: could not record interrupted attempt %d: %s",
                                                        shard_id, attempt, e)
    raise ShardInterrupted(rows_resumed + ckpt.rows_committed, left)
