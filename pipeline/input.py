"""Find a job's input files, check their columns, and cut them into shards.

INPUT is one Parquet file, a folder (every *.parquet below it), a glob, or any of those as an fsspec URL
(s3://bucket/prefix/, gs://..., file://...).
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from pipeline.config import InputError, RunConfig


@dataclass(frozen=True)
class Shard:
    """A row range of one input file: the unit of scheduling, retry and accounting.

    Attributes:
        shard_id: deterministic name, "<file index>-<first row>", from the sorted input listing.
        path: the file (protocol-less path on `fs`; see `url`).
        url: the file as an fsspec URL.
        row_start, row_end: rows [row_start, row_end) of the file; row_end is -1 when the file's footer could not
            be read at planning time (the shard then fails with the reader's error, and only it).
    """

    shard_id: str
    path: str
    url: str
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        """Rows in the shard (0 when unknown)."""
        return max(0, self.row_end - self.row_start)


def resolve_inputs(url: str) -> tuple[AbstractFileSystem, list[str]]:
    """The filesystem and the sorted Parquet files that `url` names. Raises InputError when there are none."""
    fs, path = fsspec.core.url_to_fs(url)
    if any(c in path for c in "*?["):
        files = sorted(p for p in fs.glob(path) if not fs.isdir(p))
    elif fs.isdir(path):
        # Skip hidden and underscore names below the folder (_SUCCESS, .part uploads, _temporary/): the convention
        # of Spark, Dask and Arrow datasets for files that are not data.
        files = sorted(p for p in fs.find(path) if p.endswith(".parquet")
                       and not any(part.startswith(("_", ".")) for part in p[len(path.rstrip("/")):].split("/")))
    elif fs.exists(path):
        files = [path]
    else:
        raise InputError(f"input {url!r} does not exist; give a Parquet file, a folder of them, or a glob")
    if not files:
        raise InputError(f"no Parquet files found at {url!r}; a folder must hold *.parquet files")
    return fs, files


def _url(fs: AbstractFileSystem, path: str) -> str:
    return fs.unstrip_protocol(path)


def validate_columns(fs: AbstractFileSystem, files: list[str], cfg: RunConfig) -> str:
    """Check every readable file has the prompt (or messages) column; return the column to read prompts from.

    Files whose footer cannot be read are skipped here: they fail their own shard later, not the job.
    Raises InputError naming the missing column, the columns found, and the option that fixes it.
    """
    chosen: str | None = None
    for path in files:
        try:
            with fs.open(path, "rb") as f:
                names = pq.read_schema(f).names
        except Exception:  # noqa: BLE001 - a corrupt file fails its shard, not the job
            continue
        if cfg.prompt_column in names:
            column = cfg.prompt_column
        elif cfg.messages_column in names:
            column = cfg.messages_column
        else:
            raise InputError(
                f"prompt column {cfg.prompt_column!r} not found in {_url(fs, path)}; columns found: {names}. "
                f"Name the prompt column with --prompt-column (or the chat messages column with --messages-column)")
        if chosen is not None and column != chosen:
            raise InputError(f"{_url(fs, path)} has column {column!r} but an earlier file has {chosen!r}; "
                             "all input files must use the same prompt column")
        chosen = column
    return chosen or cfg.prompt_column


def plan_shards(fs: AbstractFileSystem, files: list[str], cfg: RunConfig) -> list[Shard]:
    """Cut the files into shards of at most cfg.rows_per_shard rows, stopping after cfg.limit rows in all.

    Shard ids depend only on the sorted file list and the row ranges, so the same input and options always give
    the same shards (a rerun finds its earlier results by id).
    """
    shards: list[Shard] = []
    remaining = cfg.limit
    for i, path in enumerate(files):
        if remaining is not None and remaining <= 0:
            break
        try:
            with fs.open(path, "rb") as f:
                num_rows = pq.ParquetFile(f).metadata.num_rows
        except Exception:  # noqa: BLE001 - planned as one shard that reports the error when it runs
            shards.append(Shard(f"{i:05d}-{0:09d}", path, _url(fs, path), 0, -1))
            continue
        if remaining is not None:
            num_rows = min(num_rows, remaining)
            remaining -= num_rows
        for start in range(0, num_rows, cfg.rows_per_shard):
            end = min(start + cfg.rows_per_shard, num_rows)
            shards.append(Shard(f"{i:05d}-{start:09d}", path, _url(fs, path), start, end))
    return shards
