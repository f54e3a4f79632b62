"""Find a job's input files, pin them in the job's input manifest, check their columns, cut them into shards.

INPUT is one Parquet file, a folder (every *.parquet below it), a glob, or any of those as an fsspec URL
(s3://bucket/prefix/, gs://..., file://...).

The input manifest, OUTPUT/_manifest/input.json, is committed (create-only) when a job first starts: every input
file with its size, version (S3 ETag; locally the mtime in ns) and row count, and the options that shape shards and
results. Every later run of the job with that OUTPUT plans its shards from the manifest, never from a new listing,
so shard ids stay the same when files are added to the input folder; a pinned file whose size or version changed,
or that vanished, fails its unfinished shards (`changed_inputs`), not the job.

Manifests are never overwritten. A rerun may re-pin changed files none of whose shards committed anything (a corrupt
file fixed or removed): it commits a new revision, OUTPUT/_manifest/input-NNN.json (create-only, NNN from 001), with
those files as they are now (a removed one kept as an entry without rows, so the other files keep their indices and
shard ids). `read_manifest` reads the latest revision; jobs.runner decides which files may be re-pinned.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from pipeline.config import InputError, RunConfig
from pipeline.layout import manifest_dir, manifest_path, parse_manifest_revision
from pipeline.storage import commit_json, is_transient, list_folder, output_fs, read_json, retry_transient

MANIFEST_FORMAT = 1
# RunConfig fields that change what a row's completion is; a job's OUTPUT must not mix two settings of them.
RESULT_OPTIONS = ("prompt_column", "messages_column", "id_column", "use_chat_template", "max_tokens", "temperature",
                  "top_p", "top_k", "seed", "stop")


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


@retry_transient
def resolve_inputs(url: str) -> tuple[AbstractFileSystem, list[str]]:
    """The filesystem and the sorted Parquet files that `url` names. Raises InputError when there are none;
    transient storage errors are retried (pipeline.storage.retry_transient), then raised (OSError)."""
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


@retry_transient
def _read_schema(fs: AbstractFileSystem, path: str) -> pa.Schema:
    with fs.open(path, "rb") as f:
        return pq.read_schema(f)


def is_text_type(t: pa.DataType) -> bool:
    """Whether an Arrow column type holds text (string, large_string, string_view)."""
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages_type(t: pa.DataType) -> bool:
    """A list of structs (chat messages), or text (JSON, parsed per row)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return pa.types.is_struct(t.value_type)
    return is_text_type(t)


def _check_column_type(url: str, column: str, t: pa.DataType, messages: bool) -> None:
    """Raise InputError when a prompt column is not text (or a messages column not a list of {role, content})."""
    if pa.types.is_null(t) or (_is_messages_type(t) if messages else is_text_type(t)):
        return  # an all-null column: every row becomes an error row that says so
    want = ("a list of {role, content} structs, or JSON text" if messages else "text (string)")
    raise InputError(f"column {column!r} of {url} holds {t}, not {want}. Cast it before the job (e.g. "
                     f"`table.set_column(i, {column!r}, table[{column!r}].cast(pa.string()))`), or name another "
                     "column with --prompt-column / --messages-column")


@retry_transient
def _read_num_rows(fs: AbstractFileSystem, path: str) -> int:
    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def validate_columns(fs: AbstractFileSystem, files: list[str], cfg: RunConfig) -> str:
    """Check every readable file has the prompt (or messages) column, of a type that holds prompts (text; for
    messages a list of {role, content} or JSON text); return the column to read prompts from.

    Files whose footer cannot be read are skipped here: they fail their own shard later, not the job. Transient
    storage errors are retried, then raised (OSError): a flaky store never makes a good file look corrupt.
    Raises InputError naming the missing column, the columns found, and the option that fixes it, or naming a column
    of the wrong type (int64 prompts, say) and how to cast it.
    """
    chosen: str | None = None
    for path in files:
        try:
            schema = _read_schema(fs, path)
        except Exception as e:  # a corrupt file fails its shard, not the job
            if is_transient(e):
                raise
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
        _check_column_type(_url(fs, path), column, schema.field(column).type,
                           messages=column == cfg.messages_column != cfg.prompt_column)
        if chosen is not None and column != chosen:
            raise InputError(f"{_url(fs, path)} has column {column!r} but an earlier file has {chosen!r}; "
                             "all input files must use the same prompt column")
        chosen = column
    return chosen or cfg.prompt_column


def _num_rows(fs: AbstractFileSystem, path: str) -> int | None:
    """Rows in the file from its footer; None when the footer cannot be read (the file's shard then fails)."""
    try:
        return _read_num_rows(fs, path)
    except Exception as e:  # planned as one shard that reports the error when it runs
        if is_transient(e):
            raise
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
    the same shards (a rerun finds its earlier results by id). Jobs plan from their pinned InputManifest instead.
    """
    return cut_shards([(p, _url(fs, p), _num_rows(fs, p)) for p in files], cfg.rows_per_shard, cfg.limit)


# --- the pinned input manifest -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputFile:
    """One pinned input file.

    Attributes:
        url: the file as an fsspec URL.
        size: bytes.
        version: what changes when the object is replaced: the S3 ETag (GCS generation, Azure etag), locally
            "mtime_ns:<st_mtime_ns>".
        num_rows: rows from the Parquet footer; None when the footer could not be read (its shard fails); 0 for a
            file removed from the job (`removed`).
        removed: the file was gone when a manifest revision re-pinned it: it has no shards.
        pinned_at: when a revision re-pinned it (ISO time); None: when the job started.
    """

    url: str
    size: int
    version: str
    num_rows: int | None
    removed: bool = False
    pinned_at: str | None = None

    def changed(self, pinned_at: str | None = None) -> str | None:
        """Why the file is no longer the pinned one (other size or version, gone, or back after its removal), or
        None when it still is. `pinned_at` (an ISO time), when given, goes into the message. Transient storage
        errors are retried, then raised."""
        fs, path = fsspec.core.url_to_fs(self.url)
        try:
            size, version = file_version(fs, path)
        except FileNotFoundError:
            if self.removed:
                return None
            now = "is gone"
        else:
            if self.removed:
                now = "was removed from the job and is back"
            elif (size, version) == (self.size, self.version):
                return None
            else:
                now = f"was {self.size} bytes, version {self.version}; now {size} bytes, version {version}"
        if self.pinned_at:
            since = f"since it was re-pinned on {self.pinned_at}"
        else:
            since = f"since the job started{f' on {pinned_at}' if pinned_at else ''}"
        return (f"input changed {since}: {self.url} {now}. Restore it, or run the new input into a new OUTPUT")


@dataclass(frozen=True)
class InputManifest:
    """A job's pinned input: the files, the options that shape its shards (rows_per_shard, limit) and its results
    (RESULT_OPTIONS, the prompt column read), and when it was pinned. Shards come only from this. `revision`: 0 for
    the manifest the job started with, N for OUTPUT/_manifest/input-NNN.json (`repin`)."""

    input: str
    files: tuple[InputFile, ...]
    rows_per_shard: int
    limit: int | None
    prompt_column: str
    options: dict[str, Any]
    created_at: str
    revision: int = 0

    def shards(self) -> list[Shard]:
        """The job's shards, deterministically from the pinned files and options."""
        files = [(fsspec.core.url_to_fs(f.url)[1], f.url, f.num_rows) for f in self.files]
        return cut_shards(files, self.rows_per_shard, self.limit)

    def as_json(self) -> dict[str, Any]:
        """The manifest as committed (JSON-ready)."""
        return {"format": MANIFEST_FORMAT, "input": self.input, "rows_per_shard": self.rows_per_shard,
                "limit": self.limit, "prompt_column": self.prompt_column, "options": self.options,
                "created_at": self.created_at, "revision": self.revision, "files": [asdict(f) for f in self.files]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> InputManifest:
        """Parse a committed manifest. Raises InputError when it is not one this version reads."""
        if doc.get("format") != MANIFEST_FORMAT:
            raise InputError(f"input manifest format {doc.get('format')!r} is not {MANIFEST_FORMAT}; this OUTPUT "
                             "was written by another tokenmill version: use a new OUTPUT")
        return cls(doc["input"], tuple(InputFile(**f) for f in doc["files"]), doc["rows_per_shard"], doc["limit"],
                   doc["prompt_column"], doc["options"], doc["created_at"], doc.get("revision", 0))


def result_options(cfg: RunConfig) -> dict[str, Any]:
    """The RunConfig options that shape each row's completion (RESULT_OPTIONS), JSON-ready."""
    opts = {name: getattr(cfg, name) for name in RESULT_OPTIONS}
    opts["stop"] = list(opts["stop"])
    return opts


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


def build_manifest(input_url: str, cfg: RunConfig) -> InputManifest:
    """List and check the input now (resolve_inputs, validate_columns) and describe it as a manifest.

    Raises InputError for a missing input or column.
    """
    fs, files = resolve_inputs(input_url)
    prompt_column = validate_columns(fs, files, cfg)
    pinned = []
    for path in files:
        size, version = file_version(fs, path)
        pinned.append(InputFile(_url(fs, path), size, version, _num_rows(fs, path)))
    return InputManifest(input_url, tuple(pinned), cfg.rows_per_shard, cfg.limit, prompt_column,
                         result_options(cfg), datetime.now(UTC).isoformat(timespec="seconds"))


def read_manifest(output_url: str) -> InputManifest | None:
    """The job's pinned input manifest under OUTPUT (its latest revision: one listing of _manifest/, one read), or
    None when no job has started there."""
    fs, root = fsspec.core.url_to_fs(output_url)
    root = root.rstrip("/")
    revisions = [r for info in list_folder(fs, manifest_dir(root))
                 if (r := parse_manifest_revision(info["name"])) is not None]
    if not revisions:
        return None
    return InputManifest.from_json(read_json(fs, manifest_path(root, max(revisions))))


def absolute_url(url: str) -> str:
    """`url` as an absolute fsspec URL, so ./in, in/ and file:///abs/in name the same place, whatever the working
    directory of the process that reads it (a Dask worker's is not the client's)."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs.unstrip_protocol(path).rstrip("/")


def check_compatible(manifest: InputManifest, input_url: str, cfg: RunConfig, output_url: str) -> None:
    """Raise InputError when a run asks for other shards or other results than the job pinned in `manifest`:
    another input, rows_per_shard or limit (shard ids would not match) or another RESULT_OPTIONS value (one OUTPUT
    would mix two kinds of completions). The message names each option, both values, and the fix."""
    asked = {"input": absolute_url(input_url), "rows_per_shard": cfg.rows_per_shard, "limit": cfg.limit,
             **result_options(cfg)}
    pinned = {"input": absolute_url(manifest.input), "rows_per_shard": manifest.rows_per_shard, "limit": manifest.limit,
              **manifest.options}
    diffs = [f"{k}: the job has {pinned.get(k)!r}, this run asks for {v!r}" for k, v in asked.items()
             if pinned.get(k) != v]
    if diffs:
        raise InputError(f"{output_url} holds a job started on {manifest.created_at} with other options ("
                         f"{'; '.join(diffs)}). Rerun with the job's options to resume it, or write to a new OUTPUT")


def pin_manifest(output_url: str, input_url: str, cfg: RunConfig,
                 built: InputManifest | None = None) -> tuple[InputManifest, bool]:
    """The job's input manifest: the one pinned under OUTPUT, or, at the job's first start, a new one (`built`, or
    build_manifest's) committed create-only to OUTPUT/_manifest/input.json. Returns (manifest, True if this call
    pinned it).

    When two first starts race, the create-only commit picks one manifest and the other run adopts it.
    Raises InputError when the input is missing or lacks the prompt column (first start), or when the run's
    options differ from the pinned job's (check_compatible).
    """
    manifest = read_manifest(output_url)
    created = False
    if manifest is None:
        manifest = built or build_manifest(input_url, cfg)
        fs, root = output_fs(output_url)
        created = commit_json(fs, manifest_path(root), manifest.as_json())
        if not created:
            manifest = read_manifest(output_url) or manifest
    check_compatible(manifest, input_url, cfg, output_url)
    return manifest, created


def repinned(manifest: InputManifest, urls: list[str]) -> InputManifest:
    """The next revision of `manifest`, with the files `urls` pinned as they are now: size, version and rows read
    again, or, for a file that is gone, kept as a removed entry without rows (so the other files keep their indices
    and shard ids). Commits nothing (commit_revision does). Transient storage errors are retried, then raised."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    files = []
    for f in manifest.files:
        if f.url not in urls:
            files.append(f)
            continue
        fs, path = fsspec.core.url_to_fs(f.url)
        try:
            size, version = file_version(fs, path)
        except FileNotFoundError:
            files.append(InputFile(f.url, 0, "", 0, removed=True, pinned_at=now))
        else:
            files.append(InputFile(f.url, size, version, _num_rows(fs, path), pinned_at=now))
    return replace(manifest, files=tuple(files), revision=manifest.revision + 1)


def commit_revision(output_url: str, revised: InputManifest, why: str) -> InputManifest:
    """Commit `revised` (from `repinned`) create-only as OUTPUT/_manifest/input-NNN.json with `why` beside it. The
    caller must hold the job's lease and must only re-pin files none of whose shards committed anything
    (jobs.runner). Returns the manifest now pinned: `revised`, or the latest revision when another writer committed
    that number first. Raises what the store raises (after retries)."""
    fs, root = output_fs(output_url)
    if commit_json(fs, manifest_path(root, revised.revision), revised.as_json() | {"why": why}):
        return revised
    return read_manifest(output_url) or revised


def changed_inputs(manifest: InputManifest) -> dict[str, str]:
    """Pinned files that changed since the job started: url -> why (size or version differs, or it is gone).
    Their unfinished shards must fail rather than read other rows under the same shard ids. Transient storage
    errors are retried, then raised (OSError)."""
    changed: dict[str, str] = {}
    for f in manifest.files:
        if (why := f.changed(manifest.created_at)) is not None:
            changed[f.url] = why
    return changed
