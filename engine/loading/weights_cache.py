"""The weights cache: a GGUF file's dequantized weights in one dtype, stored once per machine as safetensors with
the config (engine.loading.loader.read_gguf_state reads and writes it), so a worker's start-up skips GGUF parsing;
and a quantized HF folder's layers as loaded (INT4 repacked, act-order permuted, INT8 as stored;
engine.loading.stored_cache), so a second load skips the conversion."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.text.tokenizer import cache_root
from schemas import settings

log = logging.getLogger(__name__)


#: Bumped whenever what a weights-cache entry holds changes (its key includes it). 3: fp32 entries also hold the
#: raw GGUF blocks of the block-quantized weights (engine.loading.loader.read_gguf_state); 4: a mixture-of-experts
#: model's stacked expert weights' blocks too.
WEIGHTS_CACHE_FORMAT = 4


def weights_cache_dir(path: str, dtype: torch.dtype, files: list[str] | None = None, variant: str = "") -> Path:
    """The cache folder of the model at `path` read into `dtype`: a GGUF file, or a model folder whose `files` (its
    weights and config) the entry is built from; `variant` names anything else the entry depends on (e.g. which
    stored integers a load keeps). A new key whenever a file (path, size, modification time), the dtype, the
    variant, torch or the cache format changes: under engine.text.tokenizer.cache_root() / "weights"."""
    if files is None:  # a GGUF file (the key as it always was: existing entries stay valid)
        st = os.stat(path)
        key = (f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{torch.__version__}|"
               f"{WEIGHTS_CACHE_FORMAT}")
    else:
        stats = [f"{os.path.basename(f)}:{os.stat(f).st_size}:{os.stat(f).st_mtime_ns}" for f in files]
        key = "|".join([os.path.realpath(path), *stats, str(dtype), variant, torch.__version__,
                        str(WEIGHTS_CACHE_FORMAT)])
    return cache_root() / "weights" / hashlib.sha256(key.encode()).hexdigest()[:24]


def weights_cache_enabled() -> bool:
    """False when TOKENMILL_WEIGHTS_CACHE=0 turns the weights cache off."""
    return settings.env_flag(settings.WEIGHTS_CACHE)


def weights_cache_metadata(folder: Path) -> dict[str, str]:
    """The string metadata a cache entry was written with (write_weights_cache's `metadata`)."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return dict(f.metadata() or {})


def read_weights_cache(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """(config, state) from a cache entry, or None when there is none or it cannot be read (then it is removed
    and rebuilt by the caller)."""
    from safetensors.torch import load_file

    if not (folder / "model.safetensors").is_file():
        return None
    try:
        cfg = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
        return cfg, load_file(folder / "model.safetensors")
    except Exception as e:  # a damaged entry: rebuild it from the model file
        log.warning("ignoring the cached weights at %s (%s: %s); rebuilding them", folder, type(e).__name__, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def write_weights_cache(folder: Path, cfg: ModelConfig, state: dict[str, torch.Tensor],
                        metadata: dict[str, str] | None = None) -> None:
    """Write a cache entry (with string `metadata` in its safetensors header) beside its place, then rename it into
    place: concurrent workers never read half an entry, and the first writer wins. Best effort: a read-only or full
    disk only loses the cache."""
    from safetensors.torch import save_file

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-")
        try:
            Path(tmp, "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
                      metadata=metadata)
            os.rename(tmp, folder)
        except OSError:  # another process got there first, or the disk is full
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, TypeError, ValueError) as e:  # also a config value JSON cannot hold: no cache, same model
        log.warning("weights cache not written at %s (%s: %s)", folder, type(e).__name__, e)
