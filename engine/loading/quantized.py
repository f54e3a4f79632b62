"""The (partly) quantized state dict of any model file tokenmill reads (GGUF file, Hugging Face folder or tokenmill
folder) under the asked-for quantization mode: what the loading entry point (engine.loading.open_model) builds a
model from through the held forms (engine.quant.forms; which stored format becomes which held form:
engine.loading.stored_formats).

quantization modes (EngineConfig.quantization):
    "none"  every weight dequantized to the compute dtype (INT4 folders too): the reference path.
    "auto"  weights stored as INT4 stay INT4: GGUF Q4_0/Q4_1/Q4_K projections natively (group 32), INT4 folders as
            saved, GPTQ/AWQ/compressed-tensors HF folders' 4-bit layers as stored where that is exact (act-order
            ones with their input permuted) and a W8A8 folder's INT8 layers as stored on the CPU
            (engine.loading.hf_quantized; the others dequantized exactly, and the load report says which and why:
            OpenedModel.quantization_loaded); everything else in the compute dtype. A mixture-of-experts model's
            experts alike, per projection of all its experts (engine.quant.experts: GGUF ffn_*_exps tensors in
            those types, a folder's per-expert layers); its router stays in the compute dtype.
    "int4"  "auto", plus every other projection weight quantized at `group_size` on load, a mixture-of-experts
            model's experts one at a time (refused for an already quantized HF folder: it would quantize twice).
    "int8"  W8A8 on the CPU (engine.quant.int8_linear): every projection as INT8 per output channel, activations
            quantized per token at run time, a mixture-of-experts model's experts per expert; loaded as "none",
            then fused, smoothed and quantized. A W8A8 HF folder keeps its stored INT8 instead ("auto"); other
            quantized HF folders are refused.
"""

from __future__ import annotations

import logging
import os

import torch

from engine.config import ModelConfig
from engine.loading.gguf_file import iter_gguf_state, read_gguf_config
from engine.loading.hf_folder import (
    hf_quant_format,
    is_hf_folder,
    iter_hf_quantized_state,
    iter_hf_state,
    read_hf_config,
)
from engine.loading.hf_quantized import KeepStored, check_quantization_mode
from engine.loading.tokenmill_folder import read_folder, read_folder_config
from engine.loading.weights_cache import read_gguf_state
from engine.quant.handler import Int4QuantHandler, dequantize_state_dict
from engine.quant.state import QuantizedState
from schemas.engine_choices import QUANTIZATIONS

QUANTIZATION_MODES = QUANTIZATIONS  # schemas.engine_choices, EngineConfig.quantization's choices

log = logging.getLogger(__name__)


def read_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a local GGUF file, HF folder or tokenmill folder, from its header or config only (no
    weights read). Raises ValueError (unsupported architecture or field, broken file) or OSError."""
    if is_hf_folder(path):
        return read_hf_config(path)
    if os.path.isdir(path):
        return read_folder_config(path)
    from engine.loading.gguf_file import open_gguf

    return read_gguf_config(open_gguf(path))


def read_state(path: str, quantization: str, group_size: int, plain_dtype: torch.dtype = torch.float32,
               device: torch.device | None = None) -> tuple[ModelConfig, QuantizedState]:
    """ModelConfig and (partly) quantized state dict on the CPU: read_model_state without the load report."""
    cfg, state, _ = read_model_state(path, quantization, group_size, plain_dtype, device)
    return cfg, state


def read_model_state(path: str, quantization: str, group_size: int, plain_dtype: torch.dtype = torch.float32,
                     device: torch.device | None = None) -> tuple[ModelConfig, QuantizedState, str | None]:
    """ModelConfig, (partly) quantized state dict on the CPU of a GGUF file, HF folder or tokenmill folder, per the
    modes in the module docstring (an HF folder's plain weights in `plain_dtype` for "none", and for every mode of an
    already quantized one: no fp32 copy of a bf16 checkpoint; INT4 quantized one tensor at a time), and for an
    already quantized HF folder the load report's line (else None; its converted layers go through the weights
    cache: engine.loading.stored_cache). `device`: where the model will run (default the CPU): a W8A8 folder's
    INT8 layers are kept as stored only on a CPU with the INT8 kernel. Raises ValueError for an unknown mode, a
    mode that would quantize a quantized folder a second time (engine.loading.hf_quantized.check_quantization_mode),
    or an unsupported file."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    if is_hf_folder(path):
        cfg = read_hf_config(path)
        fmt = hf_quant_format(path)
        if fmt is not None:
            check_quantization_mode(fmt, quantization, path)
            keep = None if quantization == "none" else stored_kernels(device or torch.device("cpu"))
            state, summary = _read_quantized_hf(path, cfg, plain_dtype, keep)
            (log.warning if "dequantized exactly (" in summary and keep else log.info)(
                "%s: %s", os.path.basename(path), summary)
            return cfg, state, summary
        items = iter_hf_state(path, cfg, plain_dtype if quantization == "none" else torch.float32)
        if quantization != "int4":
            return cfg, dict(items), None
        handler = Int4QuantHandler(group_size, include_embedding=False)
        state: QuantizedState = {}
        for name, w in items:
            state.update(handler.quantize_state_dict({name: w}))
        return cfg, state, None
    if os.path.isdir(path):
        cfg, state, _ = read_folder(path)
    elif quantization in ("none", "int8"):  # every weight dequantized: what the weights cache holds (fp32 entry)
        cfg, state = read_gguf_state(path, torch.float32)
        return cfg, state, None
    else:
        from engine.loading.gguf_file import open_gguf

        reader = open_gguf(path)
        cfg = read_gguf_config(reader)
        state = dict(iter_gguf_state(reader, cfg, native_int4=True))
    if quantization in ("none", "int8"):
        return cfg, dequantize_state_dict(state, torch.float32), None
    if quantization == "int4":
        state = Int4QuantHandler(group_size, include_embedding=False).quantize_state_dict(state)
    return cfg, state, None


def _read_quantized_hf(path: str, cfg: ModelConfig, dtype: torch.dtype,
                       keep: KeepStored | None) -> tuple[QuantizedState, str]:
    """A quantized HF folder's state (its layers kept as `keep` allows, plain tensors in `dtype`) and load report,
    through the weights cache when anything is kept (engine.loading.stored_cache: a second load skips the
    conversion)."""
    from engine.loading.hf_folder import hf_weight_files
    from engine.loading.model_files import HF_CONFIG_FILE
    from engine.loading.stored_cache import read_stored_cache, write_stored_cache

    files = [*hf_weight_files(path), os.path.join(path, HF_CONFIG_FILE)]
    cached = read_stored_cache(path, files, dtype, keep) if keep is not None else None
    if cached is not None:
        return cached
    items, report = iter_hf_quantized_state(path, cfg, dtype, keep)
    state: QuantizedState = dict(items)
    if keep is not None:
        write_stored_cache(path, files, dtype, keep, cfg, state, report.summary())
    return state, report.summary()


def stored_kernels(device: torch.device) -> KeepStored:
    """What a quantized folder's layers can keep as stored on `device`: INT4 everywhere (act-order permuted), the
    W8A8 INT8 layers on a CPU whose torch has the oneDNN int8 ops, up to the |q| its int8 GEMM sums exactly."""
    from engine.quant.int8_linear import int8_available, int8_weight_qmax

    if device.type != "cpu":
        return KeepStored()
    if not int8_available():
        return KeepStored(int8_off="torch has no oneDNN int8 ops (the W8A8 kernel)")
    return KeepStored(int8_qmax=int8_weight_qmax())

