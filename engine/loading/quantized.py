"""Load any model file tokenmill reads (GGUF file, Hugging Face folder or tokenmill folder) with the asked-for
quantization, and write quantized folders (what `tokenmill quantize` runs).

quantization modes (EngineConfig.quantization):
    "none"  every weight dequantized to the compute dtype (INT4 folders too): the reference path.
    "auto"  weights stored as INT4 stay INT4: GGUF Q4_0/Q4_1/Q4_K projections natively (group 32), INT4 folders as
            saved, GPTQ/AWQ/compressed-tensors HF folders' 4-bit layers as stored where that is exact (act-order
            ones with their input permuted) and a W8A8 folder's INT8 layers as stored on the CPU
            (engine.loading.hf_quantized; the others dequantized exactly, and the load report says which and why:
            LoadedModel.quantization_loaded); everything else in the compute dtype. A mixture-of-experts model's
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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
from engine.loading.loader import read_gguf_state
from engine.loading.model_files import resolve_model_path
from engine.loading.tokenmill_folder import is_model_folder, read_folder, read_folder_config, save_folder
from engine.model.base import ModelBase
from engine.quant.handler import Int4QuantHandler, build_model, dequantize_state_dict, held_tensors
from engine.quant.qparams import Int4Weight
from engine.quant.quantize import quantize_weights
from engine.quant.stacked_int4 import StackedInt4
from engine.quant.state import LM_HEAD, QuantizedState
from engine.text.tokenizer import Tokenizer
from schemas.engine_choices import QUANTIZATIONS

QUANTIZATION_MODES = QUANTIZATIONS  # schemas.engine_choices, EngineConfig.quantization's choices

log = logging.getLogger(__name__)


def check_experts_quantization(cfg: ModelConfig, method: str) -> None:
    """Raises ValueError when `tokenmill quantize --method gptq` would have to calibrate a mixture-of-experts
    model's experts (engine.layers.moe): GPTQ per expert (a Hessian per expert from the tokens routed to it) is not
    implemented; round-to-nearest (--method rtn, the default) quantizes them, as quantization int4 does on load."""
    if cfg.num_experts and method == "gptq":
        raise ValueError(f"tokenmill quantize --method gptq of a mixture-of-experts model ({cfg.architecture}, "
                         f"{cfg.num_experts} experts) is not implemented; use --method rtn, or run the model with "
                         "quantization int4 (each expert quantized on load)")


@dataclass
class LoadedModel:
    """A filled model with its shape, tokenizer, the count of INT4 weights (0 = plain; a StackedInt4 of experts counts
    one) and, for an already quantized HF folder, the one-line account of how its layers were loaded
    (QuantReport.summary(); None for other models), and the INT4 modules' layout on CUDA ("dual" or "single"; None
    without INT4 modules)."""

    config: ModelConfig
    model: ModelBase
    tokenizer: Tokenizer
    num_int4_modules: int
    quantization_loaded: str | None = None
    int4_layout: str | None = None


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


def load_model(model: str | None, dtype: torch.dtype, device: torch.device, *, quantization: str = "none",
               group_size: int = 128, max_positions: int | None = None,
               dequant_min_rows: int | None | str = "auto",
               int4_layout: str | Callable[[ModelConfig, list[tuple[int, int | None]]], str] = "dual") -> LoadedModel:
    """Load a GGUF file / URL, a tokenmill folder, an HF folder (quantized or not), or None (the default SmolLM2
    model) onto `device`.

    dtype: compute dtype of activations and plain weights. int4_layout: the INT4 modules' layout on CUDA ("dual" or
    "single"), or a function of the model's shape and weights (numel, INT4 group or None) that picks it
    (engine.worker.memory_fit.int4_layout_chooser). Raises FileNotFoundError (no such model) and ValueError (bad
    mode, unsupported architecture, broken file, a quantized folder asked to be quantized again).
    """
    path = resolve_model_path(model)
    if os.path.isdir(path) and not is_model_folder(path) and not is_hf_folder(path):
        raise ValueError(f"{path} is a folder but neither a Hugging Face model folder (config.json + safetensors) "
                         "nor a tokenmill model folder; pass a GGUF file or one of those folders")
    if quantization == "int8" and device.type != "cpu":
        raise ValueError(f"quantization='int8' runs on the CPU (oneDNN), not {device.type}; on a GPU use "
                         "'auto' or 'int4'")
    cfg, state, loaded = read_model_state(path, quantization, group_size, plain_dtype=dtype, device=device)
    n_int4 = sum(isinstance(v, Int4Weight | StackedInt4) for v in state.values())
    layout = None
    if n_int4:  # the INT4 modules' layout: given, or chosen for this model (engine.worker.memory_fit)
        layout = int4_layout if isinstance(int4_layout, str) else int4_layout(cfg, held_tensors(cfg, state))
        if device.type == "cuda":
            log.info("INT4 layout %s: %s packed copies of each INT4 weight on %s", layout,
                     "two (tinygemm for small batches beside GemLite)" if layout == "dual" else "one (GemLite)", device)
    llama = build_model(cfg, state, dtype, device, max_positions, dequant_min_rows, int4_layout=layout or "dual")
    tokenizer = Tokenizer.from_model_path(path)
    if quantization == "int8" and loaded is None:  # a W8A8 folder's INT8 layers are its stored ones
        from engine.quant.int8_linear import quantize_model_int8
        from engine.quant.smoothquant import CALIBRATION_TEXT, smooth_model

        llama.fuse_projections()
        calibration = torch.tensor(tokenizer.encode(CALIBRATION_TEXT), dtype=torch.int64, device=device)
        smooth_model(llama, calibration)
        quantize_model_int8(llama)
    if loaded is None and n_int4 and quantization == "auto" and not os.path.isdir(path):
        loaded = f"gguf: {n_int4} weights INT4 as stored, the others dequantized exactly"
    return LoadedModel(cfg, llama, tokenizer, n_int4, loaded, layout)


QUANTIZE_METHODS = ("rtn", "gptq")


def quantize_to_folder(model: str | None, out_dir: str, bits: int = 4, group_size: int = 128,
                       include_embedding: bool = True, *, method: str = "rtn",
                       calibration: Sequence[Sequence[str]] | None = None, calibration_samples: int = 128,
                       calibration_seq_len: int = 256, act_order: bool = True, damp: float = 0.01,
                       tune_epochs: float = 1.0, on_layer: Callable[[int, float], None] | None = None,
                       on_tune_step: Callable[[int, int, float], None] | None = None) -> dict[str, Any]:
    """Write `model` (GGUF file or folder) as a tokenmill folder: INT4 (bits=4, group-wise at group_size, the
    embedding too unless include_embedding=False) or plain bf16 (bits=16). Returns the folder's JSON config.

    method "rtn": round-to-nearest with the MSE scale fit, weights quantized one at a time from fp32, so peak memory
    is about one fp32 tensor plus the output. method "gptq" (engine.quant.gptq): the model is loaded in fp32 on the
    CPU and its decoder projections are quantized layer by layer on `calibration_samples` sequences of
    `calibration_seq_len` tokens, split evenly over the `calibration` sources (each a list of texts, joined by blank
    lines; engine.quant.calibration.calibration_batch), with `act_order` and dampening `damp`, then every group's
    scale and zero is tuned end to end for `tune_epochs` passes over the same sequences (engine.quant.tune; 0 =
    off) (defaults: the best measured on SmolLM2-135M, bench/README.md); the embedding (and a tied LM head) stays
    round-to-nearest.
    Use calibration text that is not your evaluation text. on_layer / on_tune_step: progress callbacks.
    Raises ValueError for bits other than 4 or 16, a bad group size or method, gptq without calibration text, an
    already quantized HF folder at bits 4 (check_quantization_mode: never quantized twice), or gptq of a
    mixture-of-experts model (check_experts_quantization; rtn quantizes its experts one at a time)."""
    if bits not in (4, 16):
        raise ValueError(f"bits must be 4 (INT4) or 16 (bf16), got {bits}")
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"method must be one of {QUANTIZE_METHODS}, got {method!r}")
    path = resolve_model_path(model)
    fmt = hf_quant_format(path) if bits == 4 and is_hf_folder(path) else None
    if fmt is not None:
        check_quantization_mode(fmt, "int4", path)
    handler = Int4QuantHandler(group_size, include_embedding) if bits == 4 else None
    if bits == 4 and method == "gptq":
        if not calibration or not any(calibration):
            raise ValueError("method 'gptq' needs calibration text (e.g. --calibration '../shared/data/"
                             "gsm8k_test.parquet#question,answer')")
        return _gptq_to_folder(path, out_dir, group_size, include_embedding, calibration, calibration_samples,
                               calibration_seq_len, act_order, damp, tune_epochs, on_layer, on_tune_step)
    if is_hf_folder(path):
        cfg = read_hf_config(path)
        items: Iterator[tuple[str, Any]] = iter_hf_state(path, cfg, torch.float32)
    elif os.path.isdir(path):
        cfg, stored, _ = read_folder(path)
        items = iter(dequantize_state_dict(stored, torch.float32).items())
    else:
        from engine.loading.gguf_file import open_gguf

        reader = open_gguf(path)
        cfg = read_gguf_config(reader)
        items = iter_gguf_state(reader, cfg, native_int4=False)
    state: QuantizedState = {}
    for name, w in items:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        state.update(handler.quantize_state_dict({name: w}) if handler else {name: w.to(torch.bfloat16)})
    return save_folder(out_dir, cfg, state, Tokenizer.from_model_path(path).hf_tokenizer, bits=bits,
                       group_size=group_size if bits == 4 else None, source=os.path.basename(path))


def _gptq_to_folder(path: str, out_dir: str, group_size: int, include_embedding: bool,
                    sources: Sequence[Sequence[str]], samples: int, seq_len: int, act_order: bool, damp: float,
                    tune_epochs: float, on_layer: Callable[[int, float], None] | None,
                    on_tune_step: Callable[[int, int, float], None] | None) -> dict[str, Any]:
    from engine.quant.calibration import calibration_batch

    check_experts_quantization(read_model_config(path), "gptq")
    loaded = load_model(path, torch.float32, torch.device("cpu"), quantization="none")
    cfg, llama = loaded.config, loaded.model
    calibration = calibration_batch(loaded.tokenizer, sources, samples, seq_len)
    state: QuantizedState = dict(quantize_weights(llama, group_size, include_embedding, calibration=calibration,
                                                  act_order=act_order, damp=damp, tune_epochs=tune_epochs,
                                                  on_layer=on_layer, on_tune_step=on_tune_step))
    for name, w in llama.state_dict().items():  # the norms (tuned ones included) and a kept embedding
        if name.removesuffix(".weight") not in state and not (cfg.tie_word_embeddings and name == f"{LM_HEAD}.weight"):
            state[name] = w
    return save_folder(out_dir, cfg, state, loaded.tokenizer.hf_tokenizer, bits=4, group_size=group_size,
                       source=os.path.basename(path), method="gptq")
