"""A job's pinned model: which weights and tokenizer the job runs, fingerprinted when it first starts, so a resume
never mixes the rows of two models under one OUTPUT.

The pin, OUTPUT/_manifest/model.json, is committed create-only beside the input manifest (pipeline.manifest): the
model as given (`--model`; None for the default), the path or URL it resolved to, and its files:

- a local file (a GGUF): its size, mtime and sha256. Hashing a 16 GB file takes a minute, so the hash is computed
  once per machine and cached under $TOKENMILL_CACHE_DIR/model-hashes/ (engine.text.tokenizer.cache_root), keyed by the
  file's real path, size, mtime_ns, ctime_ns and inode: any write to the file (even one that restores its mtime,
  which ctime records) makes a new key, so a cached hash is never the hash of other bytes;
- a local folder (`tokenmill quantize` output, an HF-style folder): each file that makes the model (MODEL_FILES:
  weights, config, tokenizer, chat template, index and quantization metadata), its name, size and sha256;
- an fsspec URL (s3://, gs://, ...; an object or a prefix of objects): each object's size and version (the S3
  ETag, GCS generation; pipeline.input.file_version), read from the store without downloading anything.

The model's `fingerprint` is the sha256 of its files' (name, size, digest) list, so the same bytes at another path
are the same model, and another quantization written to a folder is another model. Engine options (dtype,
quantization of a GGUF on load) are not the model: they are recorded per shard in the accounting.

jobs.runner checks the pin on the client before any shard is submitted (ModelChanged: exit 2), and each worker
checks the model it loaded against the pin before it runs a shard (jobs.task), so an engine that loaded other bytes
at the same path fails its shard instead of writing rows. Result and accounting rows carry the fingerprint.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec

from engine.loading.model_files import default_model_path, is_hub_id, is_url, resolve_model_path
from engine.text.tokenizer import cache_root
from pipeline.config import InputError
from pipeline.input import file_version
from pipeline.layout import model_pin_path
from pipeline.storage import commit_json, exists_now, output_fs, read_fs, read_json

log = logging.getLogger(__name__)

MODEL_PIN_FORMAT = 1
HASH_CACHE_DIR = "model-hashes"
# The files of a model folder that make the model (basename patterns): weights, then config, tokenizer, chat
# template, shard index (*.index.json) and quantization metadata (tokenmill_model.json, quantize_config.json).
MODEL_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.json", "tokenizer*", "*.jinja", "vocab.*",
               "merges.txt", "*.model", "*.tiktoken")


class ModelPinError(InputError):
    """The model cannot be fingerprinted (missing, unreadable, changing while it is read, or a folder with no model
    files). Exit 2 before any work."""


class ModelChanged(InputError):
    """The model differs from the one the job pinned. The message names what changed (which file, old and new size
    and hash) and the two ways out: restore the model, or write to a new OUTPUT."""


@dataclass(frozen=True)
class ModelFile:
    """One file of a pinned model.

    Attributes:
        name: its path relative to the model folder or prefix; "" for a model that is a single file (its name is not
            part of the model: the same bytes elsewhere are the same model).
        size: bytes.
        digest: "sha256:<hex>" of its bytes (local files), or "etag:<version>" (the object's ETag or generation).
        mtime_ns: the local file's st_mtime_ns when it was hashed (informational), None for objects.
    """

    name: str
    size: int
    digest: str
    mtime_ns: int | None = None


@dataclass(frozen=True)
class ModelPin:
    """A model as a job pinned it (or as it is now).

    Attributes:
        model: as given (`--model`), None for the default model.
        resolved: the absolute path or URL that was read.
        files: the model's files, sorted by name.
        pinned_at: when it was fingerprinted (ISO time, UTC).
    """

    model: str | None
    resolved: str
    files: tuple[ModelFile, ...]
    pinned_at: str

    @property
    def fingerprint(self) -> str:
        """"sha256:<hex>" over the files' (name, size, digest): equal for the same model, wherever it lies."""
        listing = "".join(f"{f.name}\t{f.size}\t{f.digest}\n" for f in self.files)
        return "sha256:" + hashlib.sha256(listing.encode()).hexdigest()

    def describe(self) -> str:
        """One line for `tokenmill status`: where the model is and its fingerprint."""
        return f"{self.resolved} ({_short(self.fingerprint)}, pinned {self.pinned_at})"

    def as_json(self) -> dict[str, Any]:
        """The pin as committed (JSON-ready)."""
        return {"format": MODEL_PIN_FORMAT, "model": self.model, "resolved": self.resolved,
                "fingerprint": self.fingerprint, "pinned_at": self.pinned_at,
                "files": [asdict(f) for f in self.files]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ModelPin:
        """Parse a committed pin. Raises InputError when it is not one this version reads."""
        if doc.get("format") != MODEL_PIN_FORMAT:
            raise InputError(f"model pin format {doc.get('format')!r} is not {MODEL_PIN_FORMAT}; this OUTPUT was "
                             "written by another tokenmill version: use a new OUTPUT")
        return cls(doc["model"], doc["resolved"], tuple(ModelFile(**f) for f in doc["files"]), doc["pinned_at"])

    def changes(self, now: ModelPin) -> str | None:
        """What differs between this pin and the model `now` (file by file: gone, new, or old vs new size and
        digest), or None when they are the same model (the same fingerprint)."""
        if now.fingerprint == self.fingerprint:
            return None
        old, new = {f.name: f for f in self.files}, {f.name: f for f in now.files}
        diffs = []
        for name in sorted(old.keys() | new.keys()):
            label = name or os.path.basename(now.resolved.rstrip("/"))
            a, b = old.get(name), new.get(name)
            if b is None:
                diffs.append(f"{label} is gone")
            elif a is None:
                diffs.append(f"{label} is new")
            elif (a.size, a.digest) != (b.size, b.digest):
                diffs.append(f"{label} was {a.size} bytes, {_short(a.digest)}; now {b.size} bytes, {_short(b.digest)}")
        return "; ".join(diffs)


def _short(digest: str) -> str:
    """"sha256 0123456789ab…" / "etag …": a digest as a reader compares it."""
    kind, _, value = digest.partition(":")
    return f"{kind} {value[:16]}{'…' if len(value) > 16 else ''}"


def resolve_model(model: str | None) -> str:
    """The path or URL the engine reads for `model`: an fsspec URL as given (nothing downloaded), a local path made
    absolute (file:// stripped), and the default model's file (None) or a Hugging Face hub id's local snapshot
    resolved as the engine resolves them (engine.loading.model_files.resolve_model_path: a hub id is downloaded once
    per machine unless HF_HUB_OFFLINE is set). Raises ModelPinError (one line, the fix) when the default model is not
    installed or the hub id cannot be found."""
    try:
        if model is None:
            return default_model_path()
        if is_hub_id(model):
            return resolve_model_path(model)
    except (OSError, ValueError) as e:
        raise ModelPinError(str(e)) from e
    if is_url(model):
        return model.rstrip("/")
    return os.path.abspath(model.removeprefix("file://"))


def _hash_cache_entry(path: str, st: os.stat_result) -> Path:
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
    return cache_root() / HASH_CACHE_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def hash_cache_entry(path: str) -> Path:
    """Where the sha256 of the local file at `path`, as it is now, is cached (file_sha256)."""
    return _hash_cache_entry(path, os.stat(path))


def file_sha256(path: str) -> str:
    """The sha256 (hex) of the local file at `path`, read once per machine: cached under
    $TOKENMILL_CACHE_DIR/model-hashes/ by real path, size, mtime_ns, ctime_ns and inode (module docstring), so an
    unchanged file is not read again. The cache entry is written beside and renamed into place (concurrent workers
    never read half an entry); a read-only cache only costs the reuse. Raises OSError when the file cannot be read
    and ModelPinError when it changed while it was hashed."""
    st = os.stat(path)
    entry = _hash_cache_entry(path, st)
    try:
        cached = json.loads(entry.read_text())
        if cached.get("size") == st.st_size and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):  # no entry yet, or a damaged one: hash the file
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    after = os.stat(path)
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
        raise ModelPinError(f"model file {path} changed while it was being hashed; run again once nothing writes "
                            "to it")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "sha256": digest}, f)
        os.replace(tmp, entry)
    except OSError as e:  # a read-only cache: the next fingerprint hashes again
        log.debug("model hash cache not written (%s)", e)
    return digest


def is_model_file(name: str) -> bool:
    """True when a folder entry named `name` (a relative path) is part of the model (MODEL_FILES; hidden files and
    folders, e.g. a download cache, are not)."""
    parts = name.split("/")
    return not any(p.startswith(".") for p in parts) and any(fnmatch.fnmatch(parts[-1], p) for p in MODEL_FILES)


def _local_files(path: str) -> tuple[ModelFile, ...]:
    if not os.path.isdir(path):
        return (ModelFile("", os.path.getsize(path), f"sha256:{file_sha256(path)}", os.stat(path).st_mtime_ns),)
    files = []
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in names:
            full = os.path.join(folder, n)
            rel = os.path.relpath(full, path).replace(os.sep, "/")
            if is_model_file(rel) and os.path.isfile(full):
                files.append(ModelFile(rel, os.path.getsize(full), f"sha256:{file_sha256(full)}",
                                       os.stat(full).st_mtime_ns))
    return tuple(sorted(files, key=lambda f: f.name))


def _object_files(url: str) -> tuple[ModelFile, ...]:
    fs, path = fsspec.core.url_to_fs(url)
    path = path.rstrip("/")
    fs.invalidate_cache(path)
    if not fs.isdir(path):
        size, version = file_version(fs, path)
        return (ModelFile("", size, f"etag:{version.strip(chr(34))}"),)
    files = []
    for found in sorted(fs.find(path)):
        rel = found[len(path):].lstrip("/")
        if is_model_file(rel):
            size, version = file_version(fs, found)
            files.append(ModelFile(rel, size, f"etag:{version.strip(chr(34))}"))
    return tuple(files)


def fingerprint_model(model: str | None) -> ModelPin:
    """The model `model` (a local GGUF file or model folder, an fsspec URL of an object or prefix, None for the
    default model) as it is now: its files' sizes and sha256 (local; cached, file_sha256) or ETags (object stores;
    nothing is downloaded). Raises ModelPinError when it is missing, unreadable, or a folder without model files;
    transient storage errors are retried, then raised."""
    resolved = resolve_model(model)
    try:
        files = _object_files(resolved) if "://" in resolved else _local_files(resolved)
    except FileNotFoundError as e:
        raise ModelPinError(f"model {resolved} does not exist ({e}); give an existing --model, or leave it out for "
                            "the default model") from e
    except PermissionError as e:
        raise ModelPinError(f"model {resolved} cannot be read ({e}); fix its permissions or give another "
                            "--model") from e
    if not files:
        raise ModelPinError(f"model {resolved} holds no model files ({', '.join(MODEL_FILES)}); give a GGUF file "
                            "or a model folder")
    return ModelPin(model, resolved, files, datetime.now(UTC).isoformat(timespec="seconds"))


def read_model_pin(output_url: str) -> ModelPin | None:
    """The model pinned under OUTPUT (OUTPUT/_manifest/model.json), or None when the job has none (not started, or
    started by a tokenmill that did not pin models)."""
    fs, root = read_fs(output_url)
    path = model_pin_path(root)
    if not exists_now(fs, path):
        return None
    return ModelPin.from_json(read_json(fs, path))


def check_model_pin(pinned: ModelPin, now: ModelPin, output_url: str) -> None:
    """Raise ModelChanged when `now` is another model than the job's `pinned` one: one line naming each changed file
    (old vs new size and hash) and the two ways out."""
    what = pinned.changes(now)
    if what is None:
        return
    where = pinned.resolved if pinned.resolved == now.resolved else f"{pinned.resolved}, now {now.resolved}"
    raise ModelChanged(f"the model differs from the one the job at {output_url} pinned on {pinned.pinned_at} "
                       f"({where}): {what}. Restore the model the job started with, or write to a new OUTPUT")


def pin_model(output_url: str, now: ModelPin) -> tuple[ModelPin, bool]:
    """The job's pinned model: the one under OUTPUT, or `now` committed create-only as OUTPUT/_manifest/model.json
    when there is none yet. Returns (the pin, True if this call committed it). Raises ModelChanged when the job's
    pinned model is not `now` (check_model_pin), and what the store raises (after retries)."""
    pinned = read_model_pin(output_url)
    created = False
    if pinned is None:
        fs, root = output_fs(output_url)
        created = commit_json(fs, model_pin_path(root), now.as_json())
        pinned = now if created else read_model_pin(output_url) or now
    check_model_pin(pinned, now, output_url)
    return pinned, created
