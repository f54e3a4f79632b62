"""Checks on the client before a job writes anything: OUTPUT, the model, and the engine's limits against the model,
each failing with JobError (exit 2) that names the path (or option), the problem and the fix. The input's checks
are pipeline.input's (files, columns, column types).

Paths are made absolute here too: a Dask worker resolves a relative path against its own working directory, not the
client's, so a relative OUTPUT would put results in one place and _SUCCESS in another.
"""

from __future__ import annotations

import json
import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

from engine.loading.gguf_header import gguf_metadata
from engine.loading.model_files import HF_CONFIG_FILE, check_model_url, hub_model_path, is_hub_id, is_url
from engine.loading.model_files import TOKENMILL_CONFIG_FILE as MODEL_FOLDER_CONFIG
from jobs.errors import JobError
from pipeline.input import absolute_url
from pipeline.storage import check_bucket
from pipeline.store_reach import StoreUnreachable, probe_endpoint, unreachable_store

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
    """Check the object store of `url` (INPUT, --model) answers before any work (pipeline.store_reach.probe_endpoint);
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
    checking a local one exists, is readable and is a GGUF file (its first 4 bytes are b"GGUF"), a model folder
    written by `tokenmill quantize`, or a Hugging Face model folder that tokenmill runs exactly (its architecture,
    config fields and tensor names: engine.loading.hf_folder.check_hf_folder, from config.json and the safetensors
    headers
    only); that an fsspec URL holds a readable GGUF file or model folder (listed and its first bytes read, not
    downloaded: engine.loading.model_files.check_model_url); that a Hugging Face hub id is in this machine's HF cache.
    Raises JobError (exit 2)."""
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
        from engine.loading.hf_folder import check_hf_folder, is_hf_folder

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
        raise JobError(f"--model {path} does not exist; give a GGUF file, a Hugging Face folder (config.json + "
                       "*.safetensors), a `tokenmill quantize` folder, an fsspec URL of one (s3://...) or a Hugging "
                       "Face hub id (org/name), or leave --model out for the default SmolLM2-135M-Instruct")
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
    _check_gguf(path)
    return path


def _check_gguf(path: str) -> None:
    """Refuse a GGUF file that tokenmill does not run exactly, from its header alone
    (engine.loading.gguf_header.GGUFHeader, a tenth of a second for a 49k-token vocabulary): its architecture, the
    metadata its family reads and every tensor name (engine.loading.gguf_config, what the engine checks again when
    it loads the file). A header the scan does not follow is left to the engine. Raises JobError (exit 2) naming
    what the file sets."""
    from engine.loading.gguf_config import gguf_name_map, read_gguf_config
    from engine.loading.gguf_header import GGUFHeader, Unfollowed

    try:
        header = GGUFHeader(path)
        gguf_name_map(header, read_gguf_config(header))
    except Unfollowed:
        return
    except (ValueError, KeyError, TypeError) as e:
        raise JobError(f"--model {path}: {e}") from e


def client_model_path(model: str | None) -> str | None:
    """The local GGUF file or model folder this client reads for `model` (as check_model returns it), resolved as the
    job's workers resolve it (pipeline.model_pin.resolve_model): the default model's file for None, a hub id's
    snapshot folder (or its one .gguf) in tokenmill's model cache or HF's own, downloaded once per machine unless
    HF_HUB_OFFLINE is set; a local path as given. None for a model at a URL: its worker reads it, the client
    downloads nothing. Raises JobError (exit 2, one line) when a hub id or the default model cannot be found."""
    from pipeline.model_pin import ModelPinError, resolve_model

    if model is not None and is_url(model):
        return None
    try:
        return resolve_model(model)
    except ModelPinError as e:
        raise JobError(f"--model: {e}") from e


def model_context(model: str | None) -> dict[str, int] | None:
    """The shape numbers of a local model (a file, a folder, a hub id in the local HF cache) that bound a request's
    length: context (tokens), layers (with a KV cache: 0 for an encoder), kv_heads, head_dim; None for a model at a
    URL (its worker reads it). `model` as check_model returns it (None: the default model). Raises JobError (exit 2)
    when the file's header cannot be read."""
    from engine.loading.hf_folder import is_hf_folder, read_hf_config

    path = client_model_path(model)
    if path is None:
        return None
    if os.path.isdir(path):
        if is_hf_folder(path):  # config.json through the architecture registry (check_model has vetted it)
            from engine.model.registry import kv_cache_layout

            hf = read_hf_config(path)
            cached = sum(s.has_cache for s in kv_cache_layout(hf))  # an encoder's layers keep none: no KV pool
            return {"context": hf.max_position_embeddings, "layers": cached,
                    "kv_heads": hf.num_kv_heads, "head_dim": hf.head_dim}
        with open(os.path.join(path, MODEL_FOLDER_CONFIG)) as f:
            cfg = json.load(f)["model_config"]
        return {"context": cfg["max_position_embeddings"], "layers": cfg["num_layers"],
                "kv_heads": cfg["num_kv_heads"], "head_dim": cfg["head_dim"]}
    try:
        arch = gguf_metadata(path, {"general.architecture"}).get("general.architecture", "llama")
        names = {"context": "context_length", "layers": "block_count", "heads": "attention.head_count",
                 "kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
                 "hidden": "embedding_length"}
        meta = gguf_metadata(path, {f"{arch}.{k}" for k in names.values()})
    except (OSError, ValueError) as e:
        raise JobError(f"--model {path}: cannot read its GGUF header ({e}); give a complete GGUF file") from e
    got = {k: meta.get(f"{arch}.{v}") for k, v in names.items()}
    heads = got["heads"] or 1
    # The engine's defaults where the file has no value (engine.loading.gguf_file.read_gguf_config).
    return {"context": int(got["context"] or 2048), "layers": int(got["layers"] or 0),
            "kv_heads": int(got["kv_heads"] or heads),
            "head_dim": int(got["head_dim"] or (got["hidden"] or 0) // heads)}


def check_device(device: str, scheduler: str | None) -> None:
    """Refuse a CUDA --device that this machine lacks when the job's workers run here (no --scheduler: an embedded
    LocalCluster), before any work; without the check every worker fails to load its engine. A cluster's workers
    are checked where they run. Raises JobError (exit 2) naming the option and the fix."""
    if scheduler is not None or not device.startswith("cuda"):
        return
    import torch

    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        have = f"{count} CUDA device{'s' if count != 1 else ''}" if count else "no CUDA device"
        raise JobError(f"--device {device}: this machine has {have}, and the job's workers run here (no --scheduler); "
                       "use --device cpu (or auto), or --scheduler of a Dask cluster with GPU workers")


def check_max_model_len(model: str | None, device: str, dtype: str, max_model_len: int | None,
                        kv_cache_gib: float | None) -> None:
    """Refuse a --max-model-len (tokens) the engine could not honour, before any work: more than the model's context
    (the engine would cut it to the context without a word), or, on the CPU, more tokens than the KV cache of
    --kv-cache-gib GiB holds (cut to the pool; None: the auto size on this machine,
    engine.worker.host.cpu_kv_budget_bytes). Imports no torch.
    `model` as check_model returns it; a remote model is checked by its worker. Raises JobError (exit 2) naming the
    option, the limit and the fix."""
    if max_model_len is None:
        return
    shape = model_context(model)
    if shape is None:
        return
    name = os.path.basename(os.path.normpath(model)) if model else "the default model (SmolLM2-135M-Instruct)"
    if max_model_len > shape["context"]:
        raise JobError(f"--max-model-len {max_model_len} is more than the context of {name}, {shape['context']} "
                       f"tokens; give at most {shape['context']}, or leave it out for "
                       "the model's context")
    from engine.config import EngineConfig
    from engine.kernels.cpu_features import cpu_flags_native_bf16
    from engine.worker.device_choice import choose_device, choose_dtype
    from engine.worker.host import cpu_kv_budget_bytes, nvidia_smi_gpus
    from engine.worker.memory_fit import kv_bytes_per_token

    try:  # the engine's choice, made without torch (as jobs.plan.model_fit makes it)
        on = choose_device(device, nvidia_smi_gpus).partition(":")[0]
    except ValueError:  # CUDA asked for where nvidia-smi lists no GPU: check_device's and the engine's to say
        return
    if on != "cpu" or not shape["layers"]:
        return  # a GPU's pool is sized from its free memory at load
    block = EngineConfig().block_size
    per_block = block * kv_bytes_per_token(shape["layers"], shape["kv_heads"], shape["head_dim"],
                                           choose_dtype(dtype, on, cpu_flags_native_bf16))
    if kv_cache_gib is None:
        budget = cpu_kv_budget_bytes(EngineConfig())
        size_of = f"the auto-sized KV cache ({budget / (1 << 30):.2f} GiB: half the memory free here)"
    else:
        budget = int(kv_cache_gib * (1 << 30))
        size_of = f"the KV cache of --kv-cache-gib {kv_cache_gib:g}"
    pool = budget // per_block * block
    if max_model_len > pool:
        raise JobError(f"--max-model-len {max_model_len} is more than {size_of} "
                       f"holds for {name} ({pool} tokens); raise --kv-cache-gib to at least "
                       f"{max_model_len * per_block / block / (1 << 30):.3f} or lower --max-model-len")


def check_quantization(model: str | None, quantization: str) -> None:
    """Raise JobError (exit 2), before any work, when --quantization int4 / int8 cannot apply to the local model: an
    already quantized Hugging Face folder would be quantized a second time (int4 on any, int8 on all but W8A8 ones:
    engine.loading.hf_quantized.check_quantization_mode; the message names its quant_method and the modes to use,
    auto or none). A mixture-of-experts model's experts are quantized like its other projections
    (engine.quant.experts). `model` as check_model returns it; a URL or hub id is checked by the engine when it
    loads."""
    if quantization in ("none", "auto") or model is None or is_url(model) or is_hub_id(model):
        return
    from engine.loading.hf_folder import hf_quant_format, is_hf_folder, read_hf_config
    from engine.loading.hf_quantized import check_quantization_mode
    from engine.model.registry import quantization_problem

    if os.path.isdir(model) and is_hf_folder(model):
        try:
            problem = quantization_problem(read_hf_config(model).architecture, quantization)
            if problem is not None:
                raise ValueError(problem.removeprefix(f"--quantization {quantization} "))
            fmt = hf_quant_format(model)
            if fmt is not None:
                check_quantization_mode(fmt, quantization, model)
        except ValueError as e:
            raise JobError(f"--quantization {quantization}: {e}") from e
