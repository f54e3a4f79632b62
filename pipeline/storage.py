"""Create-only commits of Parquet objects under OUTPUT (local folders and object stores alike).

S3 has no rename, so every object is written once, to its final deterministic key, with create-only semantics
(fsspec `pipe_file(..., mode="create")`: O_EXCL locally, If-None-Match on S3). A FileExistsError means an earlier
attempt already committed it: nothing committed is ever overwritten.
"""

from __future__ import annotations

import io

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem


def output_fs(url: str) -> tuple[AbstractFileSystem, str]:
    """Filesystem and protocol-less root path of an OUTPUT URL; creates the folder where folders exist."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    return fs, root.rstrip("/")


def commit_table(fs: AbstractFileSystem, path: str, table: pa.Table) -> bool:
    """Write `table` as Parquet to `path` unless it exists. Returns True if this call committed it, False if it
    was already there (its content is left as it is)."""
    buf = io.BytesIO()
    pq.write_table(table, buf)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    try:
        fs.pipe_file(path, buf.getvalue(), mode="create")
    except FileExistsError:
        return False
    return True


def read_table(fs: AbstractFileSystem, path: str) -> pa.Table:
    """A committed Parquet object."""
    with fs.open(path, "rb") as f:
        return pq.read_table(f)
