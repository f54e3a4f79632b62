"""Run one shard: read its rows, turn them into requests, generate, commit results and accounting."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine import LLMEngine, RequestOutput
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.storage import commit_table, output_fs, read_table, retry_transient
from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA

# Called with (rows finished, output tokens of those rows) as rows finish.
ProgressFn = Callable[[int, int], None]


class ShardError(RuntimeError):
    """The shard's input could not be read (a corrupt or vanished file). Other shards are unaffected."""


@dataclass(frozen=True)
class ShardRows:
    """The rows of one shard: ids (text) and prompts (text, message lists, or None for a missing prompt)."""

    ids: list[str]
    prompts: list[Any]


def results_path(root: str, shard_id: str) -> str:
    """Where a shard's results are committed."""
    return f"{root}/results/{shard_id}.parquet"


def accounting_path(root: str, shard_id: str, attempt: int) -> str:
    """Where a shard attempt's accounting row is committed."""
    return f"{root}/accounting/{shard_id}.attempt-{attempt:03d}.parquet"


def committed_accounting(output_url: str, shard_id: str) -> dict[str, Any] | None:
    """The accounting row of the shard's latest committed attempt when its results are committed, else None.

    A shard is done only when both its results and an accounting row exist (results are committed first).
    """
    fs, root = fsspec.core.url_to_fs(output_url)
    root = root.rstrip("/")
    if not fs.exists(results_path(root, shard_id)):
        return None
    committed = sorted(fs.glob(f"{root}/accounting/{shard_id}.attempt-*.parquet"))
    return read_table(fs, committed[-1]).to_pylist()[-1] if committed else None


@retry_transient
def _read_row_groups(shard: Shard, prompt_column: str, id_column: str) -> tuple[pa.Table, int]:
    """The row groups of the shard's file that overlap its rows, and the file row of the first one."""
    with fsspec.open(shard.url, "rb") as f, pq.ParquetFile(f) as pf:
        names = pf.schema_arrow.names
        columns = [prompt_column] + ([id_column] if id_column in names else [])
        groups, first_row, offset = [], None, 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if offset + n > shard.row_start and offset < shard.row_end:
                groups.append(g)
                first_row = offset if first_row is None else first_row
            offset += n
        table = pf.read_row_groups(groups, columns=columns) if groups else pf.schema_arrow.empty_table()
    return table, first_row or 0


def read_shard(shard: Shard, prompt_column: str, id_column: str) -> ShardRows:
    """Read rows [row_start, row_end) of the shard's file: only the row groups that overlap them.

    Transient storage errors are retried (pipeline.storage.retry_transient). Raises ShardError (with the file and
    the reader's message) when the file cannot be read.
    """
    try:
        table, first_row = _read_row_groups(shard, prompt_column, id_column)
    except Exception as e:  # noqa: BLE001 - any reader failure fails this shard with a clear message
        raise ShardError(f"cannot read {shard.url}: {e}. Fix or remove the file and run the job again") from e
    start = shard.row_start - first_row
    table = table.slice(start, shard.num_rows)
    prompts = table.column(prompt_column).to_pylist()
    if id_column in table.column_names:
        ids = [None if v is None else str(v) for v in table.column(id_column).to_pylist()]
    else:
        ids = [str(shard.row_start + i) for i in range(len(prompts))]
    ids = [i if i is not None else str(shard.row_start + k) for k, i in enumerate(ids)]
    return ShardRows(ids, prompts)


def _row_seed(seed: int | None, row_id: str) -> int | None:
    return None if seed is None else (seed * 1_000_003 + zlib.crc32(row_id.encode())) % (1 << 31)


def _prompt_problem(prompt: Any) -> str | None:
    if prompt is None:
        return "the prompt is null; fill in the prompt column for this row"
    if isinstance(prompt, str) and not prompt.strip():
        return "the prompt is empty; give it some text"
    if isinstance(prompt, list) and not prompt:
        return "the messages list is empty; give at least one {role, content} message"
    return None


def generate_rows(engine: LLMEngine, rows: ShardRows, cfg: RunConfig,
                  progress: ProgressFn | None = None) -> list[RequestOutput]:
    """One RequestOutput per row, in row order. Bad rows (null, empty, too long) become error outputs; the others
    run as one continuous batch."""
    outputs: dict[int, RequestOutput] = {}
    runnable: list[int] = []
    for k, prompt in enumerate(rows.prompts):
        problem = _prompt_problem(prompt)
        if problem:
            outputs[k] = RequestOutput(rows.ids[k], [], [], "", "error", error=problem)
        else:
            runnable.append(k)
    if progress and outputs:
        progress(len(outputs), 0)

    def on_output(out: RequestOutput) -> None:
        if progress:
            progress(1, out.num_output_tokens)

    generated = engine.generate(
        [rows.prompts[k] for k in runnable],
        [cfg.sampling_params(_row_seed(cfg.seed, rows.ids[k])) for k in runnable],
        request_ids=[str(k) for k in runnable],
        use_chat_template=cfg.use_chat_template,
        on_output=on_output,
    )
    for k, out in zip(runnable, generated, strict=True):
        out.request_id = rows.ids[k]
        outputs[k] = out
    return [outputs[k] for k in range(len(rows.prompts))]


def results_table(outputs: list[RequestOutput], model: str) -> pa.Table:
    """The results rows of a shard (schemas.RESULTS_SCHEMA)."""
    return pa.Table.from_pylist([{
        "id": o.request_id, "completion": o.text, "finish_reason": o.finish_reason,
        "prompt_tokens": o.num_prompt_tokens, "completion_tokens": o.num_output_tokens, "error": o.error,
        "model": model} for o in outputs], schema=RESULTS_SCHEMA)


def run_shard(engine: LLMEngine, shard: Shard, prompt_column: str, output_url: str, cfg: RunConfig,
              attempt: int = 1, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run one shard end to end and commit its results and accounting under `output_url`.

    Idempotent: when the shard's results are already committed, nothing runs and the committed accounting is
    returned; when only the results are (a crash between the two commits), the rows run again and this attempt's
    wall time is billed against the committed results, which are never overwritten. Returns the accounting row
    (schemas.ACCOUNTING_SCHEMA fields: tokens, seconds, USD).
    Raises ShardError when the shard's input cannot be read.
    """
    fs, root = output_fs(output_url)
    done = results_path(root, shard.shard_id)
    committed = committed_accounting(output_url, shard.shard_id)
    if committed is not None:
        return committed
    rows = read_shard(shard, prompt_column, cfg.id_column)
    t0 = time.perf_counter()
    outputs = generate_rows(engine, rows, cfg, progress)
    wall_s = time.perf_counter() - t0
    results = results_table(outputs, engine.model_name)
    if not commit_table(fs, done, results):
        # An earlier attempt committed results but died before its accounting: bill this attempt's time against
        # what is committed, so the accounting always describes the results readers see.
        results = read_table(fs, done)
    rows_n = results.num_rows
    out_tokens = int(pc.sum(results.column("completion_tokens")).as_py() or 0)
    cost = wall_s / 3600.0 * cfg.price_per_hour_usd
    errors = rows_n - results.column("error").null_count
    row = {
        "shard_id": shard.shard_id, "attempt": attempt, "input_path": shard.url, "row_start": shard.row_start,
        "row_end": shard.row_start + rows_n, "rows": rows_n, "rows_ok": rows_n - errors, "rows_error": errors,
        "input_tokens": int(pc.sum(results.column("prompt_tokens")).as_py() or 0), "output_tokens": out_tokens,
        "wall_s": wall_s, "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "device": engine.device_name, "price_per_hour_usd": cfg.price_per_hour_usd, "cost_usd": cost,
        "tokens_per_dollar": out_tokens / cost if cost > 0 else None, "model": engine.model_name,
        "finished_at": datetime.now(UTC),
    }
    commit_table(fs, accounting_path(root, shard.shard_id, attempt), pa.Table.from_pylist([row],
                                                                                         schema=ACCOUNTING_SCHEMA))
    return row
