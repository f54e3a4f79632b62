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

import json
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from engine import LLMEngine, RequestOutput, SamplingParams
from engine.llm_engine import prompt_problem
from pipeline.accounting import accounting_row, bill_earlier_attempts, read_committed_accounting
from pipeline.attempts import Heartbeat, claim_attempt, end_attempt, list_attempts
from pipeline.checkpoint import Checkpointer, committed_parts, committed_rows, completion_tokens, merge_parts
from pipeline.config import RunConfig
from pipeline.input import InputChanged, Shard, is_text_type, open_pinned
from pipeline.layout import accounting_path, checkpoints_dir, results_path
from pipeline.preemption import StopSignal, stop_deadline_s
from pipeline.row_options import ROW_ERROR_COLUMN, row_option_columns, row_overrides, row_sampling_params
from pipeline.storage import commit_table, exists_now, is_no_space, output_fs, read_table, retry_transient
from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA

log = logging.getLogger(__name__)

# Called with (rows finished, output tokens of those rows) as rows finish.
ProgressFn = Callable[[int, int], None]
# Called with (row index, its output) as each row finishes.
RowFn = Callable[[int, RequestOutput], None]


class ShardError(RuntimeError):
    """The shard's input could not be read (a corrupt or vanished file). Other shards are unaffected."""


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


@dataclass(frozen=True)
class ShardRows:
    """The rows of one shard: ids (text, or None where the id column is null) and prompts (text, message lists, or
    None for a missing prompt); per row, optionally, its own sampling values and a request error
    (pipeline.row_options; None: the input has none), and its position in the input file."""

    ids: list[str | None]
    prompts: list[Any]
    overrides: list[dict[str, Any]] | None = None
    errors: list[str | None] | None = None
    positions: list[int] | None = None  # each row's position in its input file

    def take(self, indices: list[int]) -> ShardRows:
        """The rows at `indices`, in that order."""
        def pick(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[k] for k in indices]

        return ShardRows([self.ids[k] for k in indices], [self.prompts[k] for k in indices], pick(self.overrides),
                         pick(self.errors), pick(self.positions))


@retry_transient
def _read_row_groups(shard: Shard, prompt_column: str, id_column: str,
                     pinned: tuple[int, str] | None = None) -> tuple[pa.Table, int]:
    """The row groups of the shard's file that overlap its rows, and the file row of the first one; exactly the
    `pinned` (size, version) of the file when given (pipeline.input.open_pinned)."""
    with open_pinned(shard.url, pinned) as f, pq.ParquetFile(f) as pf:
        names = pf.schema_arrow.names
        columns = [prompt_column] + ([id_column] if id_column in names else []) + row_option_columns(names)
        groups, first_row, offset = [], None, 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if offset + n > shard.row_start and offset < shard.row_end:
                groups.append(g)
                first_row = offset if first_row is None else first_row
            offset += n
        table = pf.read_row_groups(groups, columns=columns) if groups else pf.schema_arrow.empty_table()
    return table, first_row or 0


def read_shard(shard: Shard, prompt_column: str, id_column: str, *, messages: bool = False,
               pinned: tuple[int, str] | None = None) -> ShardRows:
    """Read rows [row_start, row_end) of the shard's file: only the row groups that overlap them.

    Ids are the id column's values as text (a null id stays null: results carry input_file and input_row, which
    name every row), or row positions in the file when the file has no id column. `messages`: the prompt column
    is a chat messages column; stored as text, each row is parsed as JSON (a row that is not JSON keeps its text
    and becomes an error row in generate_rows). Transient storage errors are retried
    (pipeline.storage.retry_transient). `pinned`: the (size, version) the job pinned: exactly that version is read.
    Raises InputChanged when the file is not (or stops being, mid-read) the pinned version, and ShardError (with the
    file and the reader's message) when the file cannot be read.
    """
    try:
        table, first_row = _read_row_groups(shard, prompt_column, id_column, pinned)
    except InputChanged:
        raise
    except Exception as e:  # any reader failure fails this shard with a clear message
        if type(e).__name__ == "FileExpired":  # s3fs: the object's ETag no longer matches (If-Match failed)
            raise InputChanged(f"input changed while it was read: {shard.url} was replaced (its ETag no longer "
                               "matches the pinned one). Restore it, or run the new input into a new OUTPUT") from e
        raise ShardError(f"cannot read {shard.url}: {str(e).rstrip('.')}. Fix or remove the file and run the job "
                         "again") from e
    start = shard.row_start - first_row
    table = table.slice(start, shard.num_rows)
    prompts = table.column(prompt_column).to_pylist()
    errors = None
    if messages and is_text_type(table.schema.field(prompt_column).type):
        parsed = [_parse_messages(p) for p in prompts]
        prompts = [p for p, _ in parsed]
        errors = [e for _, e in parsed]
    if id_column in table.column_names:
        ids: list[str | None] = [None if v is None else str(v) for v in table.column(id_column).to_pylist()]
    else:
        ids = [str(shard.row_start + i) for i in range(len(prompts))]
    options = {c: table.column(c).to_pylist() for c in row_option_columns(table.column_names)}
    options_errors = options.get(ROW_ERROR_COLUMN)
    if errors is None or options_errors is not None:
        errors = options_errors if errors is None else [a or b for a, b in zip(options_errors, errors, strict=True)]
    return ShardRows(ids, prompts, row_overrides(options, len(ids)), errors,
                     list(range(shard.row_start, shard.row_start + len(ids))))


def _parse_messages(text: str | None) -> tuple[Any, str | None]:
    """A messages value stored as JSON text: (the parsed list, None), or (the text, why it is not one)."""
    if text is None:
        return None, None
    try:
        value = json.loads(text)
    except ValueError as e:
        return text, (f"the messages column holds text that is not JSON ({e}); store a JSON list of "
                      '{"role": ..., "content": ...} objects, or a list of structs')
    if not isinstance(value, list):
        return text, (f"the messages column holds JSON {type(value).__name__}, not a list of "
                      '{"role": ..., "content": ...} objects')
    return value, None


def _row_seed(seed: int | None, row_key: str) -> int | None:
    return None if seed is None else (seed * 1_000_003 + zlib.crc32(row_key.encode())) % (1 << 31)


def generate_rows(engine: LLMEngine, rows: ShardRows, cfg: RunConfig, progress: ProgressFn | None = None, *,
                  on_row: RowFn | None = None, should_stop: Callable[[], bool] | None = None) -> list[RequestOutput]:
    """One RequestOutput per row, in row order. Bad rows (null, empty, too long, a request error from the input,
    out-of-range per-row sampling values) become error outputs; the others run as one continuous batch, each with
    the job's sampling and its own values put in (pipeline.row_options).

    `on_row(k, output)` is called once per finished row k (an index into `rows`), bad rows first, as it finishes:
    the checkpoint hook. `should_stop` is passed to the engine: once it returns True, unfinished rows come back with
    finish_reason "abort" (and are not passed to `on_row` or `progress`). When `on_row` or `progress` raises (a
    checkpoint commit that failed after its retries), the engine is stopped the same way, so it is left clean for
    the next shard, and the error is raised once generate returns.
    """
    outputs: dict[int, RequestOutput] = {}
    runnable: list[int] = []
    params: list[SamplingParams] = []
    for k, prompt in enumerate(rows.prompts):
        problem = (rows.errors[k] if rows.errors else None) or prompt_problem(prompt, token_ids=False)
        if not problem:
            try:
                key = rows.ids[k] if rows.ids[k] is not None else f"#{rows.positions[k] if rows.positions else k}"
                params.append(row_sampling_params(cfg.sampling_params(_row_seed(cfg.seed, key)),
                                                  rows.overrides[k] if rows.overrides else None))
            except ValueError as e:
                problem = f"this row's own sampling values: {e}"
        if problem:
            outputs[k] = RequestOutput(rows.ids[k], [], [], "", "error", error=problem)
            if on_row:
                on_row(k, outputs[k])
        else:
            runnable.append(k)
    if progress and outputs:
        progress(len(outputs), 0)

    def on_output(out: RequestOutput) -> None:
        # An exception here (a failed checkpoint commit) stops the engine, which drops the rest of the batch.
        k = int(out.request_id)
        out.request_id = rows.ids[k]
        if on_row:
            on_row(k, out)
        if progress:
            progress(1, completion_tokens(out))

    generated = engine.generate(
        [rows.prompts[k] for k in runnable],
        params,
        request_ids=[str(k) for k in runnable],
        use_chat_template=cfg.use_chat_template,
        allow_special_tokens=cfg.allow_special_tokens,
        on_output=on_output,
        should_stop=should_stop,
    )
    for k, out in zip(runnable, generated, strict=True):
        out.request_id = rows.ids[k]
        outputs[k] = out
    return [outputs[k] for k in range(len(rows.prompts))]


def run_shard(engine: LLMEngine, shard: Shard, prompt_column: str, output_url: str, cfg: RunConfig, *,
              progress: ProgressFn | None = None, should_stop: Callable[[], bool] | None = None,
              watch_notices: bool = True, pinned: tuple[int, str] | None = None,
              model_fingerprint: str | None = None) -> dict[str, Any]:
    """Run one shard end to end under `output_url`, resuming from committed checkpoints; return its accounting row
    (schemas.ACCOUNTING_SCHEMA fields: tokens, seconds, USD).

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
    fs, root = output_fs(output_url)
    committed = read_committed_accounting(fs, root, shard.shard_id)
    if committed is not None:
        return committed
    with StopSignal.from_env(output_url, notices=watch_notices) as notice:
        if notice.check_now():  # cancelled or noticed before it started: claim nothing
            raise ShardInterrupted(len(committed_rows(fs, committed_parts(fs, root, shard.shard_id))), 0)
        t0 = time.monotonic()
        attempt, _ = claim_attempt(fs, root, shard.shard_id, cfg.heartbeat_seconds)
        try:
            return _run_attempt(engine, shard, prompt_column, fs, root, cfg, attempt, t0, progress, notice,
                                should_stop, pinned, model_fingerprint)
        except ShardInterrupted:
            raise
        except Exception as e:
            try:
                end_attempt(fs, root, shard.shard_id, attempt, "failed", rows_committed=0,
                            gpu_s=time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
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


def _run_attempt(engine: LLMEngine, shard: Shard, prompt_column: str, fs: AbstractFileSystem, root: str,
                 cfg: RunConfig, attempt: int, t0: float, progress: ProgressFn | None, notice: StopSignal,
                 should_stop: Callable[[], bool] | None, pinned: tuple[int, str] | None = None,
                 model_fingerprint: str | None = None) -> dict[str, Any]:
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
            outputs = generate_rows(engine, rows.take(todo), cfg, progress,
                                    on_row=lambda j, out: ckpt.add(todo[j], out), should_stop=stop)
        wall_s = time.perf_counter() - t_gen
        generated_tokens = sum(completion_tokens(o) for o in outputs)
        aborted = sum(o.finish_reason == "abort" for o in outputs)
        if aborted:
            owner = getattr(should_stop, "__self__", None)  # a StopSignal's is_set knows why it stopped
            reason = notice.reason or (owner.reason if isinstance(owner, StopSignal) else None) or "should_stop"
            _interrupted(fs, root, shard.shard_id, attempt, ckpt, t0, rows_resumed, aborted, reason)
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
    gpu_s = time.monotonic() - t0
    earlier = bill_earlier_attempts(fs, root, shard.shard_id, attempt, list_attempts(fs, root, shard.shard_id),
                                    parts, cfg.checkpoint_seconds)
    row = accounting_row(
        shard_id=shard.shard_id, attempt=attempt, input_path=shard.url, row_start=shard.row_start, results=results,
        wall_s=wall_s, generated_tokens=generated_tokens, gpu_s=gpu_s, earlier=earlier, rows_resumed=rows_resumed,
        kv_preemptions=int(pc.sum(kv).as_py() or 0), device=engine.device_name,
        dtype=str(engine.dtype).removeprefix("torch."), quantization=engine.config.quantization,
        model=engine.model_name, price_per_hour_usd=cfg.price_per_hour_usd, model_fingerprint=model_fingerprint)
    commit_table(fs, accounting_path(root, shard.shard_id, attempt), pa.Table.from_pylist([row],
                                                                                         schema=ACCOUNTING_SCHEMA))
    return row


def _interrupted(fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, ckpt: Checkpointer, t0: float,
                 rows_resumed: int, aborted: int, reason: str) -> None:
    """Commit the finished rows within the stop deadline, record the interrupted attempt, raise ShardInterrupted."""
    try:
        ckpt.commit(deadline_s=stop_deadline_s())
    except Exception as e:  # report what is committed; the next attempt redoes the rest
        log.warning("shard %s: could not commit %d finished rows before stopping: %s", shard_id, len(ckpt.pending), e)
    left = aborted + len(ckpt.pending)
    try:
        end_attempt(fs, root, shard_id, attempt, "interrupted", rows_committed=ckpt.rows_committed,
                    gpu_s=time.monotonic() - t0, reason=reason)
    except Exception as e:  # without it the next attempt estimates this one's time instead
        (log.debug if is_no_space(e) else log.warning)("shard %s: could not record interrupted attempt %d: %s",
                                                        shard_id, attempt, e)
    raise ShardInterrupted(rows_resumed + ckpt.rows_committed, left)
