"""Create-only commits of Parquet objects under OUTPUT (local folders and object stores alike), with retries.

S3 has no rename, so every object is written once, to its final deterministic key, with create-only semantics
(`open(path, O_CREAT | O_EXCL)` locally, fsspec `pipe_file(..., mode="create")`, i.e. If-None-Match: *, on S3).
A FileExistsError means an earlier attempt already committed it: nothing committed is ever overwritten.

Local writes are atomic too: the bytes go to a hidden temporary name beside the target, are fsync'ed, and are then
hard-linked to the final name (`os.link` fails when the name exists: create-only, one writer wins), so a crash or a
full disk never leaves a short record under its final name. A full disk is one error, NoSpaceLeft (errno ENOSPC),
that says how much to free.

Object stores have no folders: nothing here creates one there, and never a bucket (a typo in OUTPUT must not become
a new bucket; `check_bucket` says it is missing). A store that cannot be reached: pipeline.store_reach.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import uuid
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

# The retry policy, full-disk test and object versions live in the engine (its model copies use them too);
# re-exported here.
from engine.loading.object_store import RETRY_ATTEMPTS as RETRY_ATTEMPTS
from engine.loading.object_store import is_no_space as is_no_space
from engine.loading.object_store import is_transient as is_transient
from engine.loading.object_store import modified_at as modified_at
from engine.loading.object_store import retry_transient
from pipeline.denied import access_denied
from pipeline.store_reach import probe_endpoint

# Protocols of object stores: flat key spaces in buckets, no folders to create (fsspec's makedirs would create the
# bucket itself).
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss", "r2"})


class NoSpaceLeft(OSError):
    """OUTPUT's device is full (errno ENOSPC). str(): one line saying how many bytes to free. Picklable (it crosses
    from Dask workers to the client as any OSError does)."""

    def __init__(self, errno_: int, message: str) -> None:
        super().__init__(errno_, message)

    def __str__(self) -> str:
        return str(self.strerror)


def is_object_store(fs: AbstractFileSystem) -> bool:
    """True for object stores (S3, GCS, Azure, ...): no folders, and buckets that only their owner creates."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(p in OBJECT_STORE_PROTOCOLS for p in protocols)


def output_fs(url: str) -> tuple[AbstractFileSystem, str]:
    """Filesystem and protocol-less root path of an OUTPUT URL; creates the folder where folders exist (never a
    bucket: on object stores nothing is created here)."""
    fs, root = fsspec.core.url_to_fs(url)
    if not is_object_store(fs):
        fs.makedirs(root, exist_ok=True)
    return fs, root.rstrip("/")


def read_fs(url: str) -> tuple[AbstractFileSystem, str]:
    """Filesystem and protocol-less root path of an OUTPUT URL, to read: creates nothing (`output_fs` is the one
    that writes)."""
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root.rstrip("/")


def check_bucket(url: str) -> None:
    """Raise FileNotFoundError (one line naming the bucket and the fix) when `url` is on an S3 bucket that does not
    exist; nothing for other stores and for buckets this user may not look at (403: its first write says more).
    What the store raises when it cannot be reached propagates (see unreachable_store)."""
    fs, path = fsspec.core.url_to_fs(url)
    if not is_object_store(fs) or not hasattr(fs, "call_s3"):
        return
    probe_endpoint(url)
    bucket = path.split("/", 1)[0]
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        raise FileNotFoundError(f"the bucket {bucket!r} of {url} does not exist (tokenmill never creates buckets); "
                                "check its name, or create it first (e.g. `aws s3 mb s3://" + bucket + "`)") from None
    except PermissionError:
        return


def create_file(fs: AbstractFileSystem, path: str, data: bytes) -> bool:
    """Write `data` to `path` unless it exists, in one create-only call (no retries; see commit_table). Returns
    True if this call created it, False if it was already there. Creates missing parent folders where folders exist.
    Locally the write is atomic (the module docstring). Raises NoSpaceLeft when the device is full, AccessDenied
    (pipeline.denied: the object, the operation and the credential) when the store refuses the write."""
    if not is_object_store(fs):
        try:
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        except OSError as e:  # NOTE: not in the try below: a file in the folder's place is no "already committed"
            if is_no_space(e):
                raise no_space_left(path, len(data)) from e
            if isinstance(e, PermissionError):
                raise access_denied(e, fs, path.rsplit("/", 1)[0], "mkdir") from e
            raise
    try:
        if isinstance(fs, LocalFileSystem):
            _create_local(path, data)
        else:
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        # Also the answer when an earlier try of the same commit landed but its response was lost.
        return False
    except PermissionError as e:  # a bucket policy, a read-only folder: name the object and who asked
        raise access_denied(e, fs, path, "s3:PutObject" if is_object_store(fs) else "create") from e
    except OSError as e:
        if is_no_space(e):
            raise no_space_left(path, len(data)) from e
        raise
    return True


def _create_local(path: str, data: bytes) -> None:
    """Atomic create-only write: temporary name, fsync, hard link to `path` (FileExistsError when taken), so `path`
    either does not exist or holds all of `data`. The temporary file is removed whatever happens."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # NOTE: link, not rename: rename would replace a committed object
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # A filesystem without hard links (some FUSE and SMB mounts): claim the name with O_EXCL and write it;
            # atomic as a claim only, as readers of checkpoint parts allow (they trust commit markers).
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(out, "wb") as f:
                f.write(data)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    try:  # the new name itself survives a power cut only once its folder is on disk
        dfd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse a folder fsync; the data itself is synced
            os.fsync(dfd)
    finally:
        os.close(dfd)


def no_space_left(path: str, needed: int) -> NoSpaceLeft:
    """The one-line error for a write of `needed` bytes to `path` that found its device full. The bytes it asks to
    free are this write's (and a few records'): only the job's client knows what the rest needs
    (pipeline.disk_need)."""
    folder = os.path.dirname(path) or "."
    try:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        block = st.f_frsize or 4096
    except OSError:
        free, block = 0, 4096
    # A file takes whole blocks; ask for this write plus a block per record a shard still writes (marker, results,
    # accounting, attempt records), so a rerun gets past the next commits too.
    need = max(-(-(needed + 8 * block - free) // block) * block, block)
    return NoSpaceLeft(errno.ENOSPC, f"no space left on the device of OUTPUT ({folder}: {free:,} bytes free, a "
                                     f"{needed:,}-byte write failed): free {need:,} bytes or more for that write alone "
                                     "and rerun the same command (what is committed stays)")


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


def parquet_file(f: Any) -> pq.ParquetFile:
    """A Parquet reader over the Python file object `f` (an fsspec file) whose footer (schema, metadata) is read on
    the calling thread; read its rows with `read_parquet`, which keeps them there too.

    pyarrow's defaults (pre_buffer, threads) read a Python file from Arrow's IO threads, and such a thread may drop
    the last reference to the file's buffers after the read has returned; a process that exits then has that thread
    ended inside C++ as it waits for the GIL (std::terminate: "terminate called without an active exception", a
    `tokenmill run` aborted after its summary, exit -6; seen in a core dump). Footer-only reads (schema, metadata)
    are on the calling thread either way."""
    return pq.ParquetFile(f, pre_buffer=False)


def read_parquet(pf: pq.ParquetFile, columns: list[str] | None = None,
                 row_groups: list[int] | None = None) -> pa.Table:
    """`columns` (None: all) of the row groups `row_groups` (None: all) of `pf` (a `parquet_file`), read on the
    calling thread only (no Arrow threads: `parquet_file` says why)."""
    if row_groups is None:
        return pf.read(columns=columns, use_threads=False)
    return pf.read_row_groups(row_groups, columns=columns, use_threads=False)


@retry_transient
def read_table(fs: AbstractFileSystem, path: str, columns: list[str] | None = None) -> pa.Table:
    """A committed Parquet object, or only `columns` of it (transient storage errors retried as in commit_table),
    read on the calling thread (`parquet_file`)."""
    with fs.open(path, "rb") as f:
        return read_parquet(parquet_file(f), columns)


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
