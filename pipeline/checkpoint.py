"""Checkpoint parts: the rows a running shard has finished, committed in small create-only pieces.

Layout under OUTPUT (paths from pipeline.layout):

    checkpoints/<shard_id>/aNNN-pPPPPP-nROWS.parquet   part PPPPP of attempt NNN: ROWS finished rows
                                                       (schemas.CHECKPOINT_PART_SCHEMA)
    checkpoints/<shard_id>/aNNN-pPPPPP-nROWS.commit    its commit marker, written after the part: attempt, part,
                                                       rows, elapsed_s (seconds since the attempt's start),
                                                       device_s (device-seconds it held so far: its share of
                                                       the worker's engine), committed_at (epoch seconds)

Readers trust only parts with a marker (a part without one may be cut short by a crash). The attempt number in the
name keeps two runs of one shard at once from colliding; the row count in the name lets `status` count committed
rows from a listing alone. The shard's result is the committed parts merged in row order, one row per position.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from fsspec import AbstractFileSystem
from tenacity import stop_after_attempt, stop_before_delay

from engine import RequestOutput
from pipeline.layout import checkpoints_dir, parse_part, part_stem
from pipeline.storage import commit_json, commit_table, list_folder, modified_at, read_table
from schemas.arrow import CHECKPOINT_PART_SCHEMA

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Part:
    """A committed checkpoint part (one whose marker exists).

    Attributes:
        attempt, index: the attempt that wrote it and its number within that attempt (from 1).
        rows: rows in the part.
        path, marker: the part and its marker (protocol-less paths).
        committed_at: the marker's last-modified time, epoch seconds (None when the store does not say).
    """

    attempt: int
    index: int
    rows: int
    path: str
    marker: str
    committed_at: float | None


def committed_parts(fs: AbstractFileSystem, root: str, shard_id: str) -> list[Part]:
    """The shard's committed parts, by (attempt, index), from one fresh listing of its own checkpoint folder."""
    markers: dict[tuple[int, int, int], float | None] = {}
    parts: set[tuple[int, int, int]] = set()
    for info in list_folder(fs, checkpoints_dir(root, shard_id)):
        name = parse_part(info["name"])
        if name:
            key, is_marker = name[:3], name[3]
            if is_marker:
                markers[key] = modified_at(info)
            else:
                parts.add(key)
    stems = {key: part_stem(root, shard_id, *key) for key in markers if key in parts}
    return [Part(*key, f"{stem}.parquet", f"{stem}.commit", markers[key]) for key, stem in sorted(stems.items())]


def committed_rows(fs: AbstractFileSystem, parts: list[Part]) -> set[int]:
    """Positions (in the shard) of the rows in `parts`: reads only their `row` column, so at most the shard's rows
    (and a few more where two attempts raced)."""
    rows: set[int] = set()
    for part in parts:
        rows.update(read_table(fs, part.path, columns=["row"]).column("row").to_pylist())
    return rows


def merge_parts(fs: AbstractFileSystem, parts: list[Part], schema: pa.Schema = CHECKPOINT_PART_SCHEMA) -> pa.Table:
    """The rows of `parts` in row order, one per position, as `schema` (a generate job's CHECKPOINT_PART_SCHEMA, or
    an embed job's schemas.arrow.embed_part_schema). Where two attempts both committed a row, the earliest part's
    copy is kept."""
    if not parts:
        return schema.empty_table()
    table = pa.concat_tables([_as_part(read_table(fs, p.path), schema) for p in parts])
    table = table.take(pc.sort_indices(table, [("row", "ascending")]))  # stable: earlier parts first per row
    rows = table.column("row").to_numpy()
    first = np.ones(len(rows), dtype=bool)
    first[1:] = rows[1:] != rows[:-1]
    return table.filter(pa.array(first))


def _as_part(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A part as `schema`; a column added since the part was written (latency_s, model_fingerprint) is null."""
    for f in schema:
        if f.name not in table.column_names:
            table = table.append_column(f, pa.nulls(table.num_rows, f.type))
    return table.select(schema.names).cast(schema)


def _logprobs(out: RequestOutput) -> list[dict[str, Any]] | None:
    """A row's logprobs as schemas.arrow.LOGPROBS_TYPE values (None when not asked for)."""
    if out.logprobs is None:
        return None
    return [{"token_id": e.token_id, "token": e.token, "logprob": e.logprob,
             "top_logprobs": [t._asdict() for t in e.top_logprobs]} for e in out.logprobs]


def completion_tokens(out: RequestOutput) -> int:
    """Tokens a row generated: all its samples' when n > 1 (as OpenAI's usage counts them)."""
    return sum(s.num_output_tokens for s in out.samples) if out.samples else out.num_output_tokens


def part_table(rows: list[tuple[int, RequestOutput]], model: str, model_fingerprint: str | None = None) -> pa.Table:
    """Finished rows (position in the shard, output) as a part (CHECKPOINT_PART_SCHEMA), each with the model name
    and fingerprint (pipeline.model_pin; None: not pinned) of the engine that generated it."""
    return pa.Table.from_pylist([{
        "id": o.request_id, "completion": o.text, "finish_reason": o.finish_reason,
        "prompt_tokens": o.num_prompt_tokens, "completion_tokens": completion_tokens(o), "error": o.error,
        "model": model, "model_fingerprint": model_fingerprint, "logprobs": _logprobs(o), "valid": o.valid,
        "samples": None if o.samples is None else [
            {"completion": s.text, "finish_reason": s.finish_reason, "completion_tokens": s.num_output_tokens,
             "valid": s.valid, "logprobs": _logprobs(s)} for s in o.samples], "note": o.note,
        "row": k, "kv_preemptions": o.num_preemptions, "latency_s": o.latency_s} for k, o in rows],
        schema=CHECKPOINT_PART_SCHEMA)


#: Finished rows (position in the shard, the engine's output), the model's name and fingerprint -> a part table:
#: part_table for generated rows, pipeline.shard_embed's for embeddings.
PartTableFn = Callable[[list[tuple[int, Any]], str, "str | None"], pa.Table]


class Checkpointer:
    """Collects one attempt's finished rows and commits them as parts, every `every_rows` rows or `every_s` seconds
    (whichever first, checked as rows are added).

    `started` is the attempt's start on time.monotonic(), so markers can say how long the attempt had run (elapsed_s,
    wall seconds); `device_s()` (optional: its DeviceClock) the device-seconds it had held (device_s, its share of a
    shared engine).
    `model_fingerprint` (pipeline.model_pin; None when the job pinned none) goes into every row. `to_table` builds
    a part of the pending rows (part_table: generated rows; an embed job's rows: pipeline.shard_embed).
    Not thread-safe: call from the thread that runs the engine.
    """

    def __init__(self, fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, model: str, *,
                 every_rows: int, every_s: float, started: float, model_fingerprint: str | None = None,
                 device_s: Callable[[], float] | None = None, to_table: PartTableFn = part_table) -> None:
        self.fs, self.root, self.shard_id, self.attempt, self.model = fs, root, shard_id, attempt, model
        self.model_fingerprint, self.to_table = model_fingerprint, to_table
        self.every_rows, self.every_s, self.started, self.device_s = every_rows, every_s, started, device_s
        self.pending: list[tuple[int, Any]] = []
        self.parts = 0
        self.rows_committed = 0  # rows this attempt committed
        self.last_commit = time.monotonic()

    def add(self, row: int, out: Any) -> None:
        """A finished row (its position in the shard and its output); commits a part when one is due."""
        self.pending.append((row, out))
        if len(self.pending) >= self.every_rows or time.monotonic() - self.last_commit >= self.every_s:
            self.commit()

    def commit(self, deadline_s: float | None = None) -> None:
        """Commit the pending rows (if any) as the next part, then its marker. With `deadline_s` (seconds), retries
        of transient errors stop once the budget is spent (a single slow request can still overrun it, up to the
        store client's own timeout); without, commit_table's usual retries. Raises what the store raises."""
        if not self.pending:
            return
        until = None if deadline_s is None else time.monotonic() + deadline_s

        def bounded(commit: Callable[..., bool]) -> Callable[..., bool]:
            if until is None:
                return commit
            return commit.retry_with(stop=stop_after_attempt(5) | stop_before_delay(max(0.0, until - time.monotonic())))

        index, rows = self.parts + 1, len(self.pending)
        stem = part_stem(self.root, self.shard_id, self.attempt, index, rows)
        # NOTE: only this attempt writes names with its number, so "already there" means an earlier try of ours landed.
        bounded(commit_table)(self.fs, f"{stem}.parquet", self.to_table(self.pending, self.model,
                                                                               self.model_fingerprint))
        bounded(commit_json)(self.fs, f"{stem}.commit", {
            "attempt": self.attempt, "part": index, "rows": rows, "elapsed_s": time.monotonic() - self.started,
            "device_s": None if self.device_s is None else self.device_s(), "committed_at": time.time()})
        self.parts, self.rows_committed = index, self.rows_committed + rows
        self.pending = []
        self.last_commit = time.monotonic()
        log.debug("shard %s attempt %d: committed part %d (%d rows)", self.shard_id, self.attempt, index, rows)
