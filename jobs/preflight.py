"""Checks on the client before a job writes anything: OUTPUT and the model, each failing with JobError (exit 2) that
names the path, the problem and the fix. The input's checks are pipeline.input's (files, columns, column types).

Paths are made absolute here too: a Dask worker resolves a relative path against its own working directory, not the
client's, so a relative OUTPUT would put results in one place and _SUCCESS in another.
"""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

from engine.model_files import check_model_url, hub_model_path, is_hub_id, is_url
from engine.quant.folder import CONFIG_FILE as MODEL_FOLDER_CONFIG
from jobs.errors import JobError
from pipeline.input import absolute_url
from pipeline.storage import StoreUnreachable, check_bucket, probe_endpoint, unreachable_store

GGUF_MAGIC = b"GGUF"


def check_output(output_url: str) -> str:
    """OUTPUT as an absolute fsspec URL, after checking a local OUTPUT can be a folder this process writes: not an
    existing file, and inside a folder it may create entries in. On S3, its bucket must exist (tokenmill never
    creates buckets: a typo must not become one) and the store must answer; other object stores are checked by
    their first write. Raises JobError (exit 2)."""
    url = absolute_url(output_url)
    fs, path = fsspec.core.url_to_fs(url)
    if not isinstance(fs, LocalFileSystem):
        try:
            check_bucket(url)
        except FileNotFoundError as e:
            raise JobError(f"OUTPUT {url}: {e}") from None
        except Exception as e:
            if (line := unreachable_store(e)) is None:
                raise
            raise JobError(f"OUTPUT {url}: {line}") from None
        return url
    if os.path.exists(path) and not os.path.isdir(path):
        raise JobError(f"OUTPUT {path} is an existing file, not a folder; give a folder path (it is created when "
                       "missing), e.g. a new one beside it")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise JobError(f"OUTPUT {path} cannot be created: {existing} is a file, not a folder; give another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "OUTPUT" if existing == path else f"the folder {existing} that would hold OUTPUT"
        raise JobError(f"OUTPUT {path} is not writable: {what} does not let this user ({_user()}) write in it; "
                       "fix its permissions or give another OUTPUT")
    return url


def check_store(url: str | None, what: str) -> None:
    """Check the object store of `url` (INPUT, --model) answers before any work (pipeline.storage.probe_endpoint);
    nothing for local paths. Raises JobError (exit 2) naming `what`, the endpoint and the variable that set it."""
    if url is None or "://" not in url:
        return
    try:
        probe_endpoint(url)
    except StoreUnreachable as e:
        raise JobError(f"{what} {url}: {e}") from None


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except Exception:  # only for the message
        return f"uid {os.getuid()}"


def check_model(model: str | None) -> str | None:
    """The model as workers must read it (a local path made absolute; None, URLs and hub ids as given), after
    checking a local one exists, is readable and is a GGUF file (its first 4 bytes are b"GGUF") or a model folder
    written by `tokenmill quantize`; that an fsspec URL holds a readable GGUF file or model folder (listed and its
    first bytes read, not downloaded: engine.model_files.check_model_url); that a Hugging Face hub id is in this
    machine's HF cache. Raises JobError (exit 2)."""
    if model is None:
        return model
    if is_url(model) or is_hub_id(model):
        try:
            if is_url(model):
                check_model_url(model)
            else:
                hub_model_path(model)
        except (OSError, ValueError) as e:
            raise JobError(f"--model: {e}") from e
        return model
    path = os.path.abspath(model.removeprefix("file://"))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, MODEL_FOLDER_CONFIG)):
            raise JobError(f"--model {path} is a folder without {MODEL_FOLDER_CONFIG}: not a tokenmill model folder. "
                           "Give a GGUF file, or a folder written by `tokenmill quantize --output DIR`")
        return path
    if not os.path.exists(path):
        raise JobError(f"--model {path} does not exist; give the path of a GGUF file (or a `tokenmill quantize` "
                       "folder), or leave --model out for the default SmolLM2-135M-Instruct")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise JobError(f"--model {path} cannot be read ({e.strerror}); fix its permissions or give another "
                       "model") from e
    if magic != GGUF_MAGIC:
        raise JobError(f"--model {path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); give a "
                       ".gguf model file (e.g. from Hugging Face, or llama.cpp's convert_hf_to_gguf.py), or a folder "
                       "written by `tokenmill quantize`")
    return path
