"""Find a job's input files, check their columns, cut them into shards.

INPUT is one Parquet file, a folder (every *.parquet below it), a glob, or any of those as an fsspec URL
(s3://bucket/prefix/, gs://..., file://...).

A job plans its shards once, from the files as they were when it started: pipeline.manifest pins them (size,
version, rows) under OUTPUT and cuts its shards with `cut_shards`; `plan_shards` plans from a listing of now.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from pipeline.config import InputError, RunConfig
from pipeline.input_columns import check_column_type, check_image_column, check_pair_column
from pipeline.storage import is_transient, retry_transient

log = logging.getLogger(__name__)


class InputChanged(RuntimeError):
    """An input file is no longer the version the job pinned (another size or version, or replaced while it was
    read). str(): one line naming the file, the two versions and the two ways out."""


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


# Files a dataset writer leaves beside its data, skipped in an input folder without a word: Hadoop's checksums.
# (Hidden and underscore names are skipped the same way: _SUCCESS, _temporary/, .part uploads, .crc of Spark.)
QUIET_SUFFIXES = (".crc",)


def resolve_inputs(url: str) -> tuple[AbstractFileSystem, list[str]]:
    """The filesystem and the sorted Parquet files that `url` names (list_inputs). Raises InputError when there are
    none; transient storage errors are retried (pipeline.storage.retry_transient), then raised (OSError)."""
    fs, files, _ = list_inputs(url)
    return fs, files


@retry_transient
def list_inputs(url: str) -> tuple[AbstractFileSystem, list[str], list[str]]:
    """The filesystem, the sorted Parquet files that `url` names (protocol-less paths), and, for a folder, the
    other files in it that were skipped as not Parquet (sorted URLs: notes.txt, a stray .csv), apart from those
    dataset writers leave beside their data, skipped without a word: hidden and underscore names below the folder
    (_SUCCESS, _temporary/, .part uploads; the convention of Spark, Dask and Arrow datasets) and QUIET_SUFFIXES
    (.crc). A file or a glob names its files itself: nothing is skipped. Raises InputError when there are no
    Parquet files; transient storage errors are retried (pipeline.storage.retry_transient), then raised (OSError)."""
    fs, path = fsspec.core.url_to_fs(url)
    skipped: list[str] = []
    if any(c in path for c in "*?["):
        files = sorted(p for p in fs.glob(path) if not fs.isdir(p))
    elif fs.isdir(path):
        root = path.rstrip("/")
        files = []
        for p in sorted(fs.find(path)):
            if any(part.startswith(("_", ".")) for part in p[len(root):].split("/")) or p.endswith(QUIET_SUFFIXES):
                continue
            (files if p.endswith(".parquet") else skipped).append(p)
        skipped = [fs.unstrip_protocol(p) for p in skipped]
    elif fs.exists(path):
        files = [path]
    else:
        raise InputError(f"input {url!r} does not exist; give a Parquet file, a folder of them, or a glob")
    if not files:
        raise InputError(f"no Parquet files found at {url!r}; a folder must hold *.parquet files")
    return fs, files, skipped


def _url(fs: AbstractFileSystem, path: str) -> str:
    return fs.unstrip_protocol(path)


# What an unreadable or corrupt Parquet file raises (pyarrow's errors; ArrowIOError is OSError): such a file fails its
# own shard. Anything else is a bug and propagates.
UNREADABLE = (pa.ArrowException, OSError)


@retry_transient
def _read_schema(fs: AbstractFileSystem, path: str) -> pa.Schema:
    with fs.open(path, "rb") as f:
        return pq.read_schema(f)


@retry_transient
def _read_num_rows(fs: AbstractFileSystem, path: str) -> int:
    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def validate_columns(fs: AbstractFileSystem, files: list[str], cfg: RunConfig) -> str:
    """Check every readable file has the prompt (or messages) column, of a type that holds prompts (text; for
    messages a list of {role, content} or JSON text), and a score job's text pair column, of text; return the column
    to read prompts from.

    Files whose footer cannot be read are skipped here: they fail their own shard later, not the job. Transient
    storage errors are retried, then raised (OSError): a flaky store never makes a good file look corrupt.
    Raises InputError naming the missing column, the columns found, and the option that fixes it, or naming a column
    of the wrong type (int64 prompts, say) and how to cast it.
    """
    chosen: str | None = None
    for path in files:
        try:
            schema = _read_schema(fs, path)
        except UNREADABLE as e:  # a corrupt file fails its shard, not the job
            if is_transient(e):
                raise
            log.warning("skipping %s while checking columns: its Parquet footer cannot be read (%s: %s); its shard "
                        "will fail", path, type(e).__name__, e)
            continue
        names = schema.names
        if cfg.prompt_column in names:
            column = cfg.prompt_column
        elif cfg.messages_column in names:
            column = cfg.messages_column
        else:
            raise InputError(
                f"prompt column {cfg.prompt_column!r} not found in {_url(fs, path)}; columns found: {names}. "
                f"Name the prompt column with --prompt-column (or the chat messages column with --messages-column)")
        check_column_type(_url(fs, path), column, schema.field(column).type,
                          messages=column == cfg.messages_column != cfg.prompt_column)
        if chosen is not None and column != chosen:
            raise InputError(f"{_url(fs, path)} has column {column!r} but an earlier file has {chosen!r}; "
                             "all input files must use the same prompt column")
        chosen = column
        if cfg.text_pair_column is not None:  # a score job's second text
            check_pair_column(_url(fs, path), cfg.text_pair_column, schema)
        if cfg.image_column is not None:  # a vision-language job's images
            check_image_column(_url(fs, path), cfg.image_column, schema)
    return chosen or cfg.prompt_column


def footer_rows(fs: AbstractFileSystem, path: str) -> int | None:
    """Rows in the file from its footer; None when the footer cannot be read (the file's shard then fails)."""
    try:
        return _read_num_rows(fs, path)
    except UNREADABLE as e:  # planned as one shard that reports the error when it runs
        if is_transient(e):
            raise
        log.warning("%s: its Parquet footer cannot be read (%s: %s); planned as one shard, which will fail",
                    path, type(e).__name__, e)
        return None


def cut_shards(files: list[tuple[str, str, int | None]], rows_per_shard: int, limit: int | None) -> list[Shard]:
    """Cut (path, url, rows or None) files, in order, into shards of at most `rows_per_shard` rows, stopping after
    `limit` rows in all. A file of unknown rows (unreadable footer) becomes one shard with row_end -1."""
    shards: list[Shard] = []
    remaining = limit
    for i, (path, url, num_rows) in enumerate(files):
        if remaining is not None and remaining <= 0:
            break
        if num_rows is None:
            shards.append(Shard(f"{i:05d}-{0:09d}", path, url, 0, -1))
            continue
        if remaining is not None:
            num_rows = min(num_rows, remaining)
            remaining -= num_rows
        for start in range(0, num_rows, rows_per_shard):
            end = min(start + rows_per_shard, num_rows)
            shards.append(Shard(f"{i:05d}-{start:09d}", path, url, start, end))
    return shards


def plan_shards(fs: AbstractFileSystem, files: list[str], cfg: RunConfig) -> list[Shard]:
    """Cut the files into shards of at most cfg.rows_per_shard rows, stopping after cfg.limit rows in all.

    Shard ids depend only on the sorted file list and the row ranges, so the same input and options always give
    the same shards (a rerun finds its earlier results by id). Jobs plan from their pinned input instead
    (pipeline.manifest.InputManifest.shards).
    """
    return cut_shards([(p, _url(fs, p), footer_rows(fs, p)) for p in files], cfg.rows_per_shard, cfg.limit)


@retry_transient
def file_version(fs: AbstractFileSystem, path: str) -> tuple[int, str]:
    """(size in bytes, version) of a file now: the S3 ETag (GCS generation, an etag elsewhere), locally the mtime
    in nanoseconds. Raises FileNotFoundError when it is gone; transient storage errors are retried."""
    fs.invalidate_cache(path)  # s3fs answers info() from a cached listing: it would miss a replaced object
    info = fs.info(path)
    if isinstance(fs, LocalFileSystem):
        return int(info["size"]), f"mtime_ns:{os.stat(path).st_mtime_ns}"
    for key in ("ETag", "etag", "generation", "md5Hash", "version_id", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            return int(info["size"]), str(info[key])
    return int(info["size"]), ""


def absolute_url(url: str) -> str:
    """`url` as an absolute fsspec URL, so ./in, in/ and file:///abs/in name the same place, whatever the working
    directory of the process that reads it (a Dask worker's is not the client's)."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs.unstrip_protocol(path).rstrip("/")


def _changed(url: str, pinned: tuple[int, str], now: tuple[int, str] | None,
             when: str = "since the job pinned it") -> str:
    was = f"was {pinned[0]} bytes, version {pinned[1]}"
    is_now = "is gone" if now is None else f"now {now[0]} bytes, version {now[1]}"
    return f"input changed {when}: {url} {was}; {is_now}. Restore it, or run the new input into a new OUTPUT"


@contextmanager
def open_pinned(url: str, pinned: tuple[int, str] | None) -> Iterator[IO[bytes]]:
    """Open the input file at `url` for reading exactly the version pinned as `pinned` = (size in bytes, version as
    file_version gives it), or as it is now when `pinned` is None.

    - Local files: the open file's own fstat must match (size, mtime_ns) and match again after the read (a rename
      over the path cannot reach an open file; an in-place write changes its mtime).
    - S3: a HEAD must show the pinned size and ETag; the object is then read by its VersionId when the bucket keeps
      versions (an overwrite after the check cannot reach the read), else with every ranged GET conditional on the
      ETag (If-Match; s3fs raises FileExpired on a mismatch).
    - Other stores: the version is compared before and after the read.
    Raises InputChanged (a mismatch, before or during the read), FileNotFoundError when it is gone, and what the store
    raises.
    """
    fs, path = fsspec.core.url_to_fs(url)
    if pinned is None:
        with fs.open(path, "rb") as f:
            yield f
        return
    pinned = (int(pinned[0]), str(pinned[1]))
    if isinstance(fs, LocalFileSystem):
        try:
            local = open(path, "rb")  # noqa: SIM115 (closed by the with below)
        except FileNotFoundError:
            raise InputChanged(_changed(url, pinned, None)) from None
        with local as f:
            before = _local_version(f)
            if before != pinned:
                raise InputChanged(_changed(url, pinned, before))
            yield f
            if (after := _local_version(f)) != before:
                raise InputChanged(_changed(url, pinned, after, "while it was read"))
        return
    if hasattr(fs, "call_s3"):  # s3fs
        fs.invalidate_cache(path)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise InputChanged(_changed(url, pinned, None)) from None
        now = (int(info["size"]), str(info.get("ETag")))
        if now != pinned:
            raise InputChanged(_changed(url, pinned, now))
        version_id = info.get("VersionId")
        if version_id and version_id != "null":
            versioned = type(fs)(**{**fs.storage_options, "version_aware": True, "skip_instance_cache": True})
            with versioned.open(path, "rb", version_id=version_id) as f:
                yield f
            return
        with fs.open(path, "rb") as f:
            etag = getattr(f, "details", {}).get("ETag")
            if etag is not None and str(etag) != pinned[1]:  # replaced between the HEAD and the open
                raise InputChanged(_changed(url, pinned, (int(f.size), str(etag))))
            yield f
        return
    before = file_version(fs, path)
    if before != pinned:
        raise InputChanged(_changed(url, pinned, before))
    with fs.open(path, "rb") as f:
        yield f
    if (after := file_version(fs, path)) != before:
        raise InputChanged(_changed(url, pinned, after, "while it was read"))


def _local_version(f: IO[bytes]) -> tuple[int, str]:
    st = os.fstat(f.fileno())
    return st.st_size, f"mtime_ns:{st.st_mtime_ns}"
