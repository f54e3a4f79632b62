"""The weights cache: a GGUF file's dequantized weights in one dtype, stored once per machine as safetensors with
the config (`read_gguf_state` reads and writes it), so a worker's start-up skips GGUF parsing;
and a quantized HF folder's layers as loaded (INT4 repacked, act-order permuted, INT8 as stored;
engine.loading.stored_cache), so a second load skips the conversion.

Bounded: its entries stay under TOKENMILL_WEIGHTS_CACHE_GB (default 64 GB) and a new entry leaves 5% of its disk
(at least 2 GB) free; room is made by removing the least recently used entries (a read marks an entry used), and
an entry that cannot fit is not written (the model still loads, from its files). Keys change with the model file,
the dtype, torch and the cache format, so without a bound every re-download or upgrade left a full copy behind."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.kernels.gguf_blocks import is_block_key
from engine.loading.gguf_file import iter_gguf_state, read_gguf_config
from engine.model.tensor_names import LM_HEAD
from engine.text.tokenizer import cache_root
from schemas import settings

log = logging.getLogger(__name__)


#: Bumped whenever what a weights-cache entry holds changes (its key includes it). 3: fp32 entries also hold the
#: raw GGUF blocks of the block-quantized weights (`read_gguf_state`); 4: a mixture-of-experts
#: model's stacked expert weights' blocks too.
WEIGHTS_CACHE_FORMAT = 4

#: The cache's size limit when TOKENMILL_WEIGHTS_CACHE_GB is unset, GB.
DEFAULT_LIMIT_GB = 64.0
#: What a new entry leaves free on the cache's disk: this share of the disk, and at least RESERVE_MIN_BYTES.
RESERVE_SHARE, RESERVE_MIN_BYTES = 0.05, 2 * 10**9
#: A writer's temporary folder this old (seconds) is a crashed writer's: removed when room is made.
STALE_TMP_S = 3600.0



def read_gguf_state(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the dequantized weights in `dtype` (CPU tensors under their HF names, a tied LM head left
    out) of the GGUF file at `path`, through the weights cache (TOKENMILL_WEIGHTS_CACHE=0 turns it off): read from
    the cache entry when there is one, else from the file, and the entry written.

    Reading a GGUF file costs seconds per process (GGUFReader parses every metadata field, the tokenizer's 49k
    strings included, then every tensor is dequantized on the CPU), and every Dask worker pays it at start-up; an
    entry (about 2 bytes per parameter in bf16) reads in a fraction of a second. For fp32 the state also holds the
    raw GGUF blocks of the block-quantized weights (`is_block_key` entries; engine.model.fill.fill_model attaches
    them to their modules: the CPU's small-batch kernel, engine.quant.forms.GGUFBlocksForm)."""
    folder = weights_cache_dir(path, dtype) if weights_cache_enabled() else None
    cached = read_weights_cache(folder) if folder is not None else None
    if cached is not None:
        return cached
    from engine.loading.gguf_file import open_gguf  # looked up per call: tests patch the one way to open a GGUF

    reader = open_gguf(path)
    cfg = read_gguf_config(reader)
    keep_blocks = dtype == torch.float32  # what the CPU's fp32 small-batch kernel reads (engine.quant.packed_linear)
    state = {name: w if is_block_key(name) else w.to(dtype=dtype)
             for name, w in iter_gguf_state(reader, cfg, keep_blocks=keep_blocks)}
    if cfg.tie_word_embeddings:
        state.pop(f"{LM_HEAD}.weight", None)
    if folder is not None:
        write_weights_cache(folder, cfg, state)
    return cfg, state

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
    """False when TOKENMILL_WEIGHTS_CACHE=0 turns the weights cache off. Raises ValueError for a bad
    TOKENMILL_WEIGHTS_CACHE or TOKENMILL_WEIGHTS_CACHE_GB (read here, before a load's work, not only at its end)."""
    settings.env_gigabytes(settings.WEIGHTS_CACHE_GB, DEFAULT_LIMIT_GB)
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
    with contextlib.suppress(OSError):  # a read-only cache (a shared volume) is still read
        os.utime(folder)  # used now: the last entry least-recently-used eviction takes
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
        if not make_room(folder.parent, sum(t.numel() * t.element_size() for t in state.values())):
            return
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


def _size(entry: Path) -> int:
    return sum(f.stat().st_size for f in entry.iterdir() if f.is_file())


def make_room(root: Path, nbytes: int) -> bool:
    """Remove the least recently used entries under the cache folder `root` until a new entry of `nbytes` bytes
    keeps the entries under TOKENMILL_WEIGHTS_CACHE_GB and leaves RESERVE_SHARE of the disk (at least
    RESERVE_MIN_BYTES) free. False, with a warning, when it cannot fit even with every entry gone (no entry is removed
    then). Crashed writers' temporary folders go first. Raises ValueError for a bad TOKENMILL_WEIGHTS_CACHE_GB."""
    limit = settings.env_gigabytes(settings.WEIGHTS_CACHE_GB, DEFAULT_LIMIT_GB)
    entries = []
    for entry in root.iterdir():
        try:
            st = entry.stat()
            if entry.name.startswith(".tmp-"):
                if time.time() - st.st_mtime > STALE_TMP_S:
                    shutil.rmtree(entry, ignore_errors=True)
            elif entry.is_dir():
                entries.append((st.st_mtime, _size(entry), entry))
        except OSError:  # removed meanwhile by another worker
            continue
    disk = shutil.disk_usage(root)
    reserve = max(RESERVE_MIN_BYTES, int(RESERVE_SHARE * disk.total))
    total, free = sum(size for _, size, _ in entries), disk.free
    if nbytes > limit or nbytes > free + total - reserve:
        log.warning("weights cache not written: the entry (%.3g GB) does not fit under TOKENMILL_WEIGHTS_CACHE_GB "
                    "(%.3g GB) while keeping %.3g GB of the disk of %s free; the model loads from its files each "
                    "time", nbytes / 1e9, limit / 1e9, reserve / 1e9, root)
        return False
    for _, size, entry in sorted(entries, key=lambda e: e[0]):  # least recently used first
        if total + nbytes <= limit and free - nbytes >= reserve:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total, free = total - size, free + size
        log.info("weights cache: removed the least recently used entry %s (%.2f GB) to make room", entry, size / 1e9)
    return True
