"""The weights cache of a quantized HF folder (GPTQ, AWQ, compressed-tensors) as loaded: its layers after the
one-time conversion (INT4 unpacked from the checkpoint's int32 words and repacked to the portable layout, act-order
columns permuted, zero points mapped; W8A8 layers' int8 as stored; the others dequantized exactly) with the load
report, so a second load of a big folder reads the result instead of converting again.

Entry (engine.loading.weights_cache: one folder per key, written atomically; TOKENMILL_WEIGHTS_CACHE=0 turns it off),
keyed by the folder's weight files and config (path, size, modification time), the dtype of its plain tensors, what
the load keeps as stored (engine.loading.hf_quantized.KeepStored: it differs between a CPU and a GPU), torch's version
and the cache format. Its safetensors file holds plain tensors by name and, per kept module X:
    INT4   X.qweight (uint8 [N, Kp/2]), X.scales, X.zeros (fp32 [N, Kp/G]) and, act-order, X.in_perm (int64 [K]);
           a mixture-of-experts block's projection stacked over its E experts ([E, ...] each: StackedInt4)
    INT8   X.int8 (int8 [N, K]) and X.int8_scale (fp32 [N])
and in its header "tokenmill_int4" (JSON {X: [in_features, group_size]}), "tokenmill_int8" (JSON [X, ...]) and
"tokenmill_report" (the load report's line).
"""

from __future__ import annotations

import json
import logging

import torch

from engine.config import ModelConfig
from engine.loading.hf_quantized import KeepStored
from engine.loading.weights_cache import (
    read_weights_cache,
    weights_cache_dir,
    weights_cache_enabled,
    weights_cache_metadata,
    write_weights_cache,
)
from engine.quant.qparams import Int4Weight, Int8Weight
from engine.quant.stacked_int4 import StackedInt4
from engine.quant.state import QuantizedState

log = logging.getLogger(__name__)


def encode_state(state: QuantizedState, report: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header metadata) of a loaded quantized state (module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    int4: dict[str, list[int]] = {}
    int8: list[str] = []
    for name, v in state.items():
        if isinstance(v, Int4Weight | StackedInt4):
            int4[name] = [v.in_features, v.group_size]
            tensors.update({f"{name}.qweight": v.qweight, f"{name}.scales": v.scales, f"{name}.zeros": v.zeros})
            if v.in_perm is not None:
                tensors[f"{name}.in_perm"] = v.in_perm
        elif isinstance(v, Int8Weight):
            int8.append(name)
            tensors.update({f"{name}.int8": v.qweight, f"{name}.int8_scale": v.scale})
        else:
            tensors[name] = v
    return tensors, {"tokenmill_int4": json.dumps(int4), "tokenmill_int8": json.dumps(int8),
                     "tokenmill_report": report}


def decode_state(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[QuantizedState, str]:
    """Inverse of encode_state: (state, report). Raises KeyError or ValueError for an entry that does not hold
    what its header names."""
    state: QuantizedState = {}
    for name, (in_features, group_size) in json.loads(meta["tokenmill_int4"]).items():
        parts = [tensors.pop(f"{name}.{p}") for p in ("qweight", "scales", "zeros")]
        kind = StackedInt4 if parts[0].dim() == 3 else Int4Weight
        state[name] = kind(*parts, in_features, group_size, tensors.pop(f"{name}.in_perm", None))
    for name in json.loads(meta["tokenmill_int8"]):
        state[name] = Int8Weight(tensors.pop(f"{name}.int8"), tensors.pop(f"{name}.int8_scale"))
    state.update(tensors)
    return state, meta["tokenmill_report"]


def _entry(path: str, files: list[str], dtype: torch.dtype, keep: KeepStored):
    return weights_cache_dir(path, dtype, files, f"hf-quantized|{keep}")


def read_stored_cache(path: str, files: list[str], dtype: torch.dtype,
                      keep: KeepStored) -> tuple[QuantizedState, str] | None:
    """(state, report) of the quantized HF folder at `path` (built from `files`) loaded with `keep` and plain
    tensors in `dtype`, from its cache entry; None when there is none, the cache is off, or the entry cannot be read
    (then it is removed, and the caller loads the folder and writes it again)."""
    if not weights_cache_enabled():
        return None
    folder = _entry(path, files, dtype, keep)
    cached = read_weights_cache(folder)
    if cached is None:
        return None
    try:
        return decode_state(cached[1], weights_cache_metadata(folder))
    except (KeyError, ValueError, TypeError) as e:
        import shutil

        log.warning("ignoring the cached weights at %s (%s: %s); rebuilding them", folder, type(e).__name__, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def write_stored_cache(path: str, files: list[str], dtype: torch.dtype, keep: KeepStored, cfg: ModelConfig,
                       state: QuantizedState, report: str) -> None:
    """Write the cache entry read_stored_cache reads (best effort, as write_weights_cache)."""
    if weights_cache_enabled():
        tensors, meta = encode_state(state, report)
        write_weights_cache(_entry(path, files, dtype, keep), cfg, tensors, meta)
