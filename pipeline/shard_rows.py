"""Read one shard's rows from its Parquet file: only the row groups that overlap it, exactly the pinned version, with
its ids, prompts (text or chat messages), a score job's text pairs, per-row sampling values and request errors
(pipeline.row_options)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.input import InputChanged, Shard, open_pinned
from pipeline.input_columns import is_text_type
from pipeline.row_options import ROW_ERROR_COLUMN, row_option_columns, row_overrides
from pipeline.storage import RETRY_ATTEMPTS, is_transient, parquet_file, read_parquet, retry_transient


class ShardError(RuntimeError):
    """The shard's input could not be read (a corrupt or vanished file). Other shards are unaffected."""


@dataclass(frozen=True)
class ShardRows:
    """The rows of one shard: ids (text, or None where the id column is null) and prompts (text, message lists, or
    None for a missing prompt); per row, optionally, its own sampling values and a request error
    (pipeline.row_options; None: the input has none), its position in the input file, a score job's second text
    (`pairs`, text or None; None for the other tasks), and the image column's values (`images`: as read, one cell
    per row; pipeline.images turns them into image prompts; None without --image-column)."""

    ids: list[str | None]
    prompts: list[Any]
    overrides: list[dict[str, Any]] | None = None
    errors: list[str | None] | None = None
    positions: list[int] | None = None  # each row's position in its input file
    pairs: list[Any] | None = None  # a score job's text pair column
    images: list[Any] | None = None  # the image column's cells

    def take(self, indices: list[int]) -> ShardRows:
        """The rows at `indices`, in that order."""
        def pick(values: list[Any] | None) -> list[Any] | None:
            return None if values is None else [values[k] for k in indices]

        return ShardRows([self.ids[k] for k in indices], [self.prompts[k] for k in indices], pick(self.overrides),
                         pick(self.errors), pick(self.positions), pick(self.pairs), pick(self.images))


@retry_transient
def _read_row_groups(shard: Shard, prompt_column: str, id_column: str, pinned: tuple[int, str] | None = None,
                     pair_column: str | None = None, image_column: str | None = None) -> tuple[pa.Table, int]:
    """The row groups of the shard's file that overlap its rows (its prompt, id, text pair, image and row option
    columns), and the file row of the first one; exactly the `pinned` (size, version) of the file when given
    (pipeline.input.open_pinned)."""
    with open_pinned(shard.url, pinned) as f, parquet_file(f) as pf:
        names = pf.schema_arrow.names
        columns = list(dict.fromkeys([prompt_column] + ([id_column] if id_column in names else [])
                                     + row_option_columns(names) + ([pair_column] if pair_column else [])
                                     + ([image_column] if image_column else [])))
        groups, first_row, offset = [], None, 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if offset + n > shard.row_start and offset < shard.row_end:
                groups.append(g)
                first_row = offset if first_row is None else first_row
            offset += n
        table = read_parquet(pf, columns, groups) if groups else pf.schema_arrow.empty_table()
    return table, first_row or 0


def read_shard(shard: Shard, prompt_column: str, id_column: str, *, messages: bool = False,
               pinned: tuple[int, str] | None = None, pair_column: str | None = None,
               image_column: str | None = None) -> ShardRows:
    """Read rows [row_start, row_end) of the shard's file: only the row groups that overlap them.

    Ids are the id column's values as text (a null id stays null: results carry input_file and input_row, which
    name every row), or row positions in the file when the file has no id column. `messages`: the prompt column
    is a chat messages column; stored as text, each row is parsed as JSON (a row that is not JSON keeps its text
    and becomes an error row in generate_rows). Transient storage errors are retried
    (pipeline.storage.retry_transient). `pinned`: the (size, version) the job pinned: exactly that version is read.
    `pair_column`: a score job's text pair column, read into ShardRows.pairs; `image_column`: the images column,
    read into ShardRows.images as stored (bytes, {bytes, path} dicts, text, lists of those).
    Raises InputChanged when the file is not (or stops being, mid-read) the pinned version, and ShardError (with the
    file and the reader's message) when the file cannot be read.
    """
    try:
        table, first_row = _read_row_groups(shard, prompt_column, id_column, pinned, pair_column, image_column)
    except InputChanged:
        raise
    except Exception as e:  # any reader failure fails this shard with a clear message
        if type(e).__name__ == "FileExpired":  # s3fs: the object's ETag no longer matches (If-Match failed)
            raise InputChanged(f"input changed while it was read: {shard.url} was replaced (its ETag no longer "
                               "matches the pinned one). Restore it, or run the new input into a new OUTPUT") from e
        if is_transient(e):  # the store, not the file: retry_transient's tries all failed
            raise ShardError(f"cannot read {shard.url}: the store kept failing ({str(e).rstrip('.')}) through "
                             f"{RETRY_ATTEMPTS} tries; run the job again (committed rows are kept)") from e
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
                     list(range(shard.row_start, shard.row_start + len(ids))),
                     table.column(pair_column).to_pylist() if pair_column else None,
                     table.column(image_column).to_pylist() if image_column else None)


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


