"""Checks on the client before a job writes anything: OUTPUT and the model, each failing with JobError (exit 2) that
names the path, the problem and the fix. The input's checks are pipeline.input's (files, columns, column types).

Paths are made absolute here too: a Dask worker resolves a relative path against its own working directory, not the
client's, so a relative OUTPUT would put results in one place and _SUCCESS in another.
"""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

from engine.quant.folder import CONFIG_FILE as MODEL_FOLDER_CONFIG
from jobs.errors import JobError
from pipeline.input import absolute_url

GGUF_MAGIC = b"GGUF"


def check_output(output_url: str) -> str:
    """OUTPUT as an absolute fsspec URL, after checking a local OUTPUT can be a folder this process writes: not an
    existing file, and inside a folder it may create entries in. Object stores are checked by their first write.
    Raises JobError (exit 2)."""
    url = absolute_url(output_url)
    fs, path = fsspec.core.url_to_fs(url)
    if not isinstance(fs, LocalFileSystem):
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


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except Exception:  # only for the message
        return f"uid {os.getuid()}"


def check_model(model: str | None) -> str | None:
    """The model as workers must read it (a local path made absolute; None and remote URLs as given), after
    checking a local one exists, is readable and is a GGUF file (its first 4 bytes are b"GGUF"), a model folder
    written by `tokenmill quantize`, or a Hugging Face model folder that tokenmill runs exactly (its architecture,
    config fields and tensor names: engine.loader.check_hf_folder, from config.json and the safetensors headers
    only). Remote URLs are checked when a worker fetches them. Raises JobError (exit 2)."""
    if model is None or ("://" in model and not model.startswith("file://")):
        return model
    path = os.path.abspath(model.removeprefix("file://"))
    if os.path.isdir(path):
        from engine.loader import HF_CONFIG_FILE, check_hf_folder, is_hf_folder

        if is_hf_folder(path):
            try:
                check_hf_folder(path)
            except (ValueError, OSError, KeyError) as e:
                raise JobError(f"--model {path}: {e}") from e
            return path
        if not os.path.isfile(os.path.join(path, MODEL_FOLDER_CONFIG)):
            raise JobError(f"--model {path} is a folder without {MODEL_FOLDER_CONFIG} or {HF_CONFIG_FILE}: not a "
                           "tokenmill model folder nor a Hugging Face one. Give a GGUF file, a Hugging Face folder "
                           "(config.json + *.safetensors), or a folder written by `tokenmill quantize --output DIR`")
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
