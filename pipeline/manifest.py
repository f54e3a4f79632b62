"""A job's input manifest: the input files pinned when the job first starts, and its re-pin revisions.

The input manifest, OUTPUT/_manifest/input.json, is committed (create-only) when a job first starts: every input
file with its size, version (S3 ETag; locally the mtime in ns) and row count, and the options that shape shards and
results. Every later run of the job with that OUTPUT plans its shards from the manifest, never from a new listing,
so shard ids stay the same when files are added to the input folder; a pinned file whose size or version changed,
or that vanished, fails its unfinished shards (`changed_inputs`), not the job.

Manifests are never overwritten. A rerun may re-pin changed files none of whose shards committed anything (a corrupt
file fixed or removed): it commits a new revision, OUTPUT/_manifest/input-NNN.json (create-only, NNN from 001), with
those files as they are now (a removed one kept as an entry without rows, so the other files keep their indices and
shard ids). `read_manifest` reads the latest revision; jobs.runner decides which files may be re-pinned.
Listing the input, checking its columns and cutting shards are pipeline.input's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

import fsspec

from pipeline.config import InputError, RunConfig
from pipeline.input import (
    Shard,
    absolute_url,
    cut_shards,
    file_version,
    footer_rows,
    list_inputs,
    resolve_inputs,
    validate_columns,
)
from pipeline.layout import manifest_dir, manifest_path, parse_manifest_revision
from pipeline.storage import commit_json, list_folder, output_fs, read_fs, read_json
from schemas.job_spec import Embedding, Sampling

MANIFEST_FORMAT = 1
# RunConfig fields that change what a row's completion is; a job's OUTPUT must not mix two settings of them.
RESULT_OPTIONS = ("prompt_column", "messages_column", "id_column", "use_chat_template", "allow_special_tokens",
                  "text_pair_column", "image_column", "max_images_per_row", "max_pixels", "min_pixels",
                  *Sampling.model_fields, *Embedding.model_fields)
# Sampling, embed and column options added since manifests were first written: a manifest without them ran with
# their defaults (no text pair column: no score job).
_LATER_DEFAULTS = {name: list(v) if isinstance(v, tuple) else v
                   for name, v in (Sampling().model_dump() | Embedding().model_dump()).items()
                   if name not in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
                   } | {"text_pair_column": None, "image_column": None, "max_images_per_row": None,
                        "max_pixels": None, "min_pixels": None}


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

    def difference(self) -> str | None:
        """How the file differs now from its pin, after its URL ("is gone", "was removed from the job and is back",
        "was N bytes, version V; now M bytes, version W"), or None when it is still the pinned one. Transient
        storage errors are retried, then raised."""
        fs, path = fsspec.core.url_to_fs(self.url)
        try:
            size, version = file_version(fs, path)
        except FileNotFoundError:
            return None if self.removed else "is gone"
        if self.removed:
            return "was removed from the job and is back"
        if (size, version) == (self.size, self.version):
            return None
        return f"was {self.size} bytes, version {self.version}; now {size} bytes, version {version}"

    def changed(self, pinned_at: str | None = None) -> str | None:
        """Why the file is no longer the pinned one (difference), with the two ways out, or None when it still is.
        `pinned_at` (an ISO time), when given, goes into the message. Transient storage errors are retried, then
        raised."""
        now = self.difference()
        if now is None:
            return None
        if self.pinned_at:
            since = f"since it was re-pinned on {self.pinned_at}"
        else:
            since = f"since the job started{f' on {pinned_at}' if pinned_at else ''}"
        return (f"input changed {since}: {self.url} {now}. Restore it, or run the new input into a new OUTPUT")


@dataclass(frozen=True)
class InputManifest:
    """A job's pinned input: the files, the options that shape its shards (rows_per_shard, limit) and its results
    (RESULT_OPTIONS, the prompt column read), and when it was pinned. Shards come only from this. `revision`: 0 for
    the manifest the job started with, N for OUTPUT/_manifest/input-NNN.json (`repin`). `skipped`: the files of the
    input folder left out as not Parquet when it was pinned (URLs; pipeline.input.list_inputs)."""

    input: str
    files: tuple[InputFile, ...]
    rows_per_shard: int
    limit: int | None
    prompt_column: str
    options: dict[str, Any]
    created_at: str
    revision: int = 0
    skipped: tuple[str, ...] = ()

    def shards(self) -> list[Shard]:
        """The job's shards, deterministically from the pinned files and options."""
        files = [(fsspec.core.url_to_fs(f.url)[1], f.url, f.num_rows) for f in self.files]
        return cut_shards(files, self.rows_per_shard, self.limit)

    def as_json(self) -> dict[str, Any]:
        """The manifest as committed (JSON-ready)."""
        return {"format": MANIFEST_FORMAT, "input": self.input, "rows_per_shard": self.rows_per_shard,
                "limit": self.limit, "prompt_column": self.prompt_column, "options": self.options,
                "created_at": self.created_at, "revision": self.revision, "files": [asdict(f) for f in self.files],
                "skipped": list(self.skipped)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> InputManifest:
        """Parse a committed manifest. Raises InputError when it is not one this version reads."""
        if doc.get("format") != MANIFEST_FORMAT:
            raise InputError(f"input manifest format {doc.get('format')!r} is not {MANIFEST_FORMAT}; this OUTPUT "
                             "was written by another tokenmill version: use a new OUTPUT")
        # A job pinned before allow_special_tokens existed parsed control-token text in prompts: it resumes with
        # --allow-special-tokens (what it ran with), never silently under the other encoding.
        options = {"allow_special_tokens": True, **_LATER_DEFAULTS, **doc["options"]}
        return cls(doc["input"], tuple(InputFile(**f) for f in doc["files"]), doc["rows_per_shard"], doc["limit"],
                   doc["prompt_column"], options, doc["created_at"], doc.get("revision", 0),
                   tuple(doc.get("skipped", ())))


def result_options(cfg: RunConfig) -> dict[str, Any]:
    """The RunConfig options that shape each row's completion (RESULT_OPTIONS), JSON-ready."""
    return {name: list(v) if isinstance(v := getattr(cfg, name), tuple) else v for name in RESULT_OPTIONS}


def build_manifest(input_url: str, cfg: RunConfig) -> InputManifest:
    """List and check the input now (list_inputs, validate_columns) and describe it as a manifest, with the files
    of a folder skipped as not Parquet.

    Raises InputError for a missing input or column.
    """
    fs, files, skipped = list_inputs(input_url)
    prompt_column = validate_columns(fs, files, cfg)
    pinned = []
    for path in files:
        size, version = file_version(fs, path)
        pinned.append(InputFile(fs.unstrip_protocol(path), size, version, footer_rows(fs, path)))
    return InputManifest(input_url, tuple(pinned), cfg.rows_per_shard, cfg.limit, prompt_column,
                         result_options(cfg), datetime.now(UTC).isoformat(timespec="seconds"), skipped=tuple(skipped))


def read_manifest(output_url: str) -> InputManifest | None:
    """The job's pinned input manifest under OUTPUT (its latest revision: one listing of _manifest/, one read), or
    None when no job has started there."""
    fs, root = read_fs(output_url)
    revisions = [r for info in list_folder(fs, manifest_dir(root))
                 if (r := parse_manifest_revision(info["name"])) is not None]
    if not revisions:
        return None
    return InputManifest.from_json(read_json(fs, manifest_path(root, max(revisions))))


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
            files.append(InputFile(f.url, size, version, footer_rows(fs, path), pinned_at=now))
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


def input_changes(manifest: InputManifest) -> list[str]:
    """How the job's input differs now from its pinned `manifest`, one entry a file: each pinned file changed or
    gone ("URL was N bytes, ...; now ..."), then each Parquet file the input lists now and the manifest does not
    pin ("URL is new"). [] when it is the same. An input that no longer lists (its folder gone) adds no new file:
    its pinned files say they are gone. Transient storage errors are retried, then raised (OSError)."""
    found = [f"{f.url} {why}" for f in manifest.files if (why := f.difference()) is not None]
    try:
        fs, paths = resolve_inputs(absolute_url(manifest.input))
    except InputError:
        return found
    pinned = {f.url for f in manifest.files}
    return found + [f"{url} is new (the job did not pin it)" for path in paths
                    if (url := fs.unstrip_protocol(path)) not in pinned]


def changed_inputs(manifest: InputManifest) -> dict[str, str]:
    """Pinned files that changed since the job started: url -> why (size or version differs, or it is gone).
    Their unfinished shards must fail rather than read other rows under the same shard ids. Transient storage
    errors are retried, then raised (OSError)."""
    changed: dict[str, str] = {}
    for f in manifest.files:
        if (why := f.changed(manifest.created_at)) is not None:
            changed[f.url] = why
    return changed
