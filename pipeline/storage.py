"""Create-only commits of Parquet objects under OUTPUT (local folders and object stores alike), with retries.

S3 has no rename, so every object is written once, to its final deterministic key, with create-only semantics
(`open(path, O_CREAT | O_EXCL)` locally, fsspec `pipe_file(..., mode="create")`, i.e. If-None-Match: *, on S3).
A FileExistsError means an earlier attempt already committed it: nothing committed is ever overwritten.

NOTE: the local create is atomic as a claim (one writer wins the name) but not as a write: a crash mid-write leaves
a short file. That is why checkpoint parts get a commit marker and readers trust only parts with one.
"""

from __future__ import annotations

import errno
import io
import json
import os
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential

# errnos that s3fs and the OS give for a server or network having a bad moment (s3fs: SlowDown and
# ServiceUnavailable -> EBUSY, InternalError -> EREMOTEIO).
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EREMOTEIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                     errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE}


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying (throttling, 5xx, timeouts, connection resets); False for answers that
    a retry cannot change (exists, not found, access denied, a corrupt file)."""
    if isinstance(exc, FileExistsError | FileNotFoundError | PermissionError | IsADirectoryError):
        return False
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


# NOTE: s3fs/botocore retry inside each call too; the layers multiply, so keep this one short (<= ~1 min in all).
retry_transient = retry(retry=retry_if_exception(is_transient), wait=wait_random_exponential(multiplier=0.5, max=15),
                        stop=stop_after_attempt(5), reraise=True)


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


def modified_at(info: dict[str, Any]) -> float | None:
    """Last-modified time of a listed entry, seconds since the epoch (local mtime, S3 LastModified); None if the
    store does not say."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, int | float):
            return float(value)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
    return None


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
