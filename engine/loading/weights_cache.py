"""The weights cache: a GGUF file's dequantized weights in one dtype, stored once per machine as safetensors with
the config (engine.loading.loader.read_gguf_state reads and writes it), so a worker's start-up skips GGUF parsing."""

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

log = logging.getLogger(__name__)


#: Bumped whenever what a weights-cache entry holds changes (its key includes it). 3: fp32 entries also hold the
#: raw GGUF blocks of the block-quantized weights (engine.loading.loader.read_gguf_state).
WEIGHTS_CACHE_FORMAT = 3



def weights_cache_dir(path: str, dtype: torch.dtype) -> Path:
    """The cache folder of the GGUF file at `path` dequantized to `dtype` (a new key whenever the file, the dtype,
    torch or the cache format changes): under engine.text.tokenizer.cache_root() / "weights"."""
    st = os.stat(path)
    key = (f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{torch.__version__}|"
           f"{WEIGHTS_CACHE_FORMAT}")
    return cache_root() / "weights" / hashlib.sha256(key.encode()).hexdigest()[:24]


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


def write_weights_cache(folder: Path, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Write a cache entry beside its place, then rename it into place: concurrent workers never read half an
    entry, and the first writer wins. Best effort: a read-only or full disk only loses the cache."""
    from safetensors.torch import save_file

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-")
        try:
            Path(tmp, "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"))
            os.rename(tmp, folder)
        except OSError:  # another process got there first, or the disk is full
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, TypeError, ValueError) as e:  # also a config value JSON cannot hold: no cache, same model
        log.warning("weights cache not written at %s (%s: %s)", folder, type(e).__name__, e)
