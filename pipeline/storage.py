"""Create-only commits of Parquet objects under OUTPUT (local folders and object stores alike), with retries.

S3 has no rename, so every object is written once, to its final deterministic key, with create-only semantics
(`open(path, O_CREAT | O_EXCL)` locally, fsspec `pipe_file(..., mode="create")`, i.e. If-None-Match: *, on S3).
A FileExistsError means an earlier attempt already committed it: nothing committed is ever overwritten.

NOTE: the local create is atomic as a claim (one writer wins the name) but not as a write: a crash mid-write leaves
a short file. That is why checkpoint parts get a commit marker and readers trust only parts with one.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

# The retry policy and object versions live in the engine (its model copies use them too); re-exported here.
from engine.object_store import is_transient as is_transient
from engine.object_store import modified_at as modified_at
from engine.object_store import retry_transient


def output_fs(url: str) -> tuple[AbstractFileSystem, str]:
    """Filesystem and protocol-less root path of an OUTPUT URL; creates the folder where folders exist."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    return fs, root.rstrip("/")


def create_file(fs: AbstractFileSystem, path: str, data: bytes) -> bool:
    """Write `data` to `path` unless it exists, in one create-only call (no retries; see commit_table). Returns
    True if this call created it, False if it was already there. Creates missing parent folders."""
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    try:
        if isinstance(fs, LocalFileSystem):
            # fsspec's local "create" mode checks, then writes: two writers could both win. O_EXCL cannot.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        else:
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        # Also the answer when an earlier try of the same commit landed but its response was lost.
        return False
    return True


def table_bytes(table: pa.Table) -> bytes:
    """`table` as a Parquet file's bytes."""
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


@retry_transient
def commit_table(fs: AbstractFileSystem, path: str, table: pa.Table) -> bool:
    """Write `table` as Parquet to `path` unless it exists. Returns True if this call committed it, False if it
    was already there (its content is left as it is). Transient storage errors are retried with exponential
    backoff and jitter (5 attempts); others raise (PermissionError, OSError)."""
    return create_file(fs, path, table_bytes(table))


@retry_transient
def read_table(fs: AbstractFileSystem, path: str, columns: list[str] | None = None) -> pa.Table:
    """A committed Parquet object, or only `columns` of it (transient storage errors retried as in commit_table)."""
    with fs.open(path, "rb") as f:
        return pq.read_table(f, columns=columns)


@retry_transient
def list_folder(fs: AbstractFileSystem, path: str) -> list[dict[str, Any]]:
    """The entries directly under `path` as fsspec info dicts (name, size, mtime or LastModified), fresh from the
    store (s3fs caches listings: a stale one would hide a commit made since); [] when the folder does not exist."""
    fs.invalidate_cache(path)
    try:
        return fs.ls(path, detail=True)
    except FileNotFoundError:
        return []


@retry_transient
def exists_now(fs: AbstractFileSystem, path: str) -> bool:
    """Whether `path` exists, asked of the store itself rather than a cached listing."""
    fs.invalidate_cache(path)
    return fs.exists(path)


@retry_transient
def commit_json(fs: AbstractFileSystem, path: str, obj: Any) -> bool:
    """Write `obj` as JSON to `path` unless it exists (create-only, retried as commit_table). Returns True if this
    call committed it, False if it was already there."""
    return create_file(fs, path, json.dumps(obj, indent=1, default=str).encode())


@retry_transient
def read_json(fs: AbstractFileSystem, path: str) -> Any:
    """A committed JSON object (transient storage errors retried as in commit_table). Raises FileNotFoundError, and
    ValueError for a short or corrupt file (a local create-only write cut by a crash)."""
    with fs.open(path, "rb") as f:
        return json.loads(f.read())
