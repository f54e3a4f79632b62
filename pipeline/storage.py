"""Create-only commits of Parquet objects under OUTPUT (local folders and object stores alike), with retries.

S3 has no rename, so every object is written once, to its final deterministic key, with create-only semantics
(fsspec `pipe_file(..., mode="create")`: O_EXCL locally, If-None-Match on S3). A FileExistsError means an earlier
attempt already committed it: nothing committed is ever overwritten.
"""

from __future__ import annotations

import errno
import io
import json
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
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


@retry_transient
def commit_table(fs: AbstractFileSystem, path: str, table: pa.Table) -> bool:
    """Write `table` as Parquet to `path` unless it exists. Returns True if this call committed it, False if it
    was already there (its content is left as it is). Transient storage errors are retried with exponential
    backoff and jitter (5 attempts); others raise (PermissionError, OSError)."""
    buf = io.BytesIO()
    pq.write_table(table, buf)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    try:
        fs.pipe_file(path, buf.getvalue(), mode="create")
    except FileExistsError:
        # Also the answer when an earlier try of this call landed but its response was lost.
        return False
    return True


@retry_transient
def read_table(fs: AbstractFileSystem, path: str) -> pa.Table:
    """A committed Parquet object (transient storage errors retried as in commit_table)."""
    with fs.open(path, "rb") as f:
        return pq.read_table(f)


@retry_transient
def commit_json(fs: AbstractFileSystem, path: str, obj: Any) -> bool:
    """Write `obj` as JSON to `path` unless it exists (create-only, retried as commit_table). Returns True if this
    call committed it, False if it was already there."""
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    try:
        fs.pipe_file(path, json.dumps(obj, indent=1, default=str).encode(), mode="create")
    except FileExistsError:
        return False
    return True
