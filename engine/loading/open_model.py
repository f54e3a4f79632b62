"""The one loading entry point: `open_model` reads any model tokenmill reads (a GGUF file or fsspec URL, a Hugging
Face folder, quantized or not, a tokenmill folder; None = the default model) with the asked-for quantization and
returns it filled on its device, with its tokenizer. What LLMEngine.from_model, `tokenmill perplexity`, GPTQ's
calibration model (engine.ptq.to_folder) and the tests load with.

Inside, three ways (the weight's path: docs/architecture.md): a plain Hugging Face folder under "none" streams its
tensors into a meta-device model (`_load_hf`); a GGUF file under "none" reads its dequantized weights through the
weights cache (`_load_gguf`); everything else (a quantized folder, a tokenmill folder, any mode but "none") reads
a (partly) quantized state dict (engine.loading.quantized.read_model_state: the modes, each stored format's held
form: engine.loading.stored_formats) and builds the model through the held forms (engine.quant.handler.build_model,
engine.quant.forms), "int8" then the INT8 W8A8 form's from-float step (SmoothQuant, then INT8: `_load_quantized`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from engine.config import ModelConfig
from engine.loading.gguf_native_int4 import gguf_dequantized_note
from engine.loading.hf_folder import hf_quant_format, is_hf_folder, iter_hf_state, read_hf_config
from engine.loading.model_files import is_url, resolve_model_path, url_model_name
from engine.loading.quantized import read_model_state
from engine.loading.tokenmill_folder import is_model_folder
from engine.loading.weights_cache import read_gguf_state
from engine.model.base import ModelBase
from engine.model.fill import fill_model
from engine.model.registry import build_model, quantization_problem
from engine.multimodal.processor import ImageProcessor
from engine.quant import handler
from engine.quant.forms import Int4GroupForm, Int8W8A8Form, StackedInt4Form, held_form_of
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: int4_layout: a layout name, or a function of the model's shape and held weights (numel, INT4 group or None)
#: that picks one (engine.worker.memory_fit.int4_layout_chooser).
Int4Layout = str | Callable[[ModelConfig, list[tuple[int, int | None]]], str]


class OpenedModel(NamedTuple):
    """A filled model on its device and what came with it.

    Attributes:
        config, model: the model's shape and the model.
        tokenizer: its tokenizer (None when open_model was told not to read it).
        name: the model's name (its file or folder name).
        quantization_loaded: how an already quantized HF folder's or GGUF file's layers were loaded (the load
            report's line; for a quantized GGUF under "none", gguf_native_int4.gguf_dequantized_note); else None.
        path: the local path it was read from (its sentence-transformers files: engine.pooling).
        image_processor: a vision-language model's (engine.multimodal.processor); None otherwise.
        num_int4_modules: the count of INT4 weights (0 = none; a StackedInt4 of experts counts one).
        int4_layout: the INT4 modules' layout on CUDA ("dual" or "single"); None without INT4 modules.
    """

    config: ModelConfig
    model: ModelBase
    tokenizer: Tokenizer | None
    name: str
    quantization_loaded: str | None = None
    path: str = ""
    image_processor: ImageProcessor | None = None
    num_int4_modules: int = 0
    int4_layout: str | None = None


def open_model(model: str | None, dtype: torch.dtype, device: torch.device, *, quantization: str = "none",
               group_size: int = 128, max_positions: int | None = None, int4_layout: Int4Layout = "dual",
               image_pixels: tuple[int | None, int | None] = (None, None), tokenizer: bool = True) -> OpenedModel:
    """Load `model` (a GGUF path or fsspec URL, a Hugging Face model folder, a tokenmill folder; None = the default
    SmolLM2-135M-Instruct Q4_1) onto `device` in `dtype` (activations and plain weights) with `quantization`
    (EngineConfig.quantization: engine.loading.quantized's modes) at `group_size` (int4_group_size).

    int4_layout: the INT4 modules' layout on CUDA ("dual" or "single"), or a function that picks it (Int4Layout).
    image_pixels: a vision-language model's (max, min) pixels per image (EngineConfig.max_image_pixels,
    min_image_pixels), through its image processor (engine.multimodal.pixel_limits; a text-only model ignores them).
    tokenizer: False skips the tokenizer (a folder of weights alone; OpenedModel.tokenizer None; not with "int8",
    whose calibration reads text). The model is built on the meta device and each tensor assigned once, so weights
    never exist twice. Raises FileNotFoundError (no such model), ValueError (unsupported architecture, bad mode, a
    mode the model cannot take, a folder that is no model, broken file, pixel limits the image processor cannot
    honour)."""
    path = resolve_model_path(model)
    name = os.path.basename(os.path.normpath(path))
    if quantization == "none" and is_hf_folder(path) and hf_quant_format(path) is None:
        cfg = read_hf_config(path)
        images = None if cfg.vision is None else ImageProcessor.from_model_path(path, cfg.vision, *image_pixels)
        if images is not None and images.vision != cfg.vision:  # LLaVA-NeXT's pinpoints the limits keep
            cfg = replace(cfg, vision=images.vision)
        llama = _load_hf(path, cfg, dtype, device, max_positions)
        if not tokenizer:
            return OpenedModel(cfg, llama, None, name, path=path, image_processor=images)
        tok = Tokenizer.from_model_path(path)
        if images is not None and not tok.has_chat_template and images.chat_template:
            tok.use_chat_template(images.chat_template)  # a processor's chat_template.json / .jinja
        return OpenedModel(cfg, llama, tok, name, path=path, image_processor=images)
    if quantization == "none" and not os.path.isdir(path):
        cfg, llama = _load_gguf(path, dtype, device, max_positions)
        note = gguf_dequantized_note(path, str(dtype).removeprefix("torch."))  # "none" dequantized Q4_1 weights
        return OpenedModel(cfg, llama, Tokenizer.from_gguf(path) if tokenizer else None, name, note, path)
    return _load_quantized(path, name, dtype, device, quantization, group_size, max_positions, int4_layout, tokenizer)


def _load_hf(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
             max_positions: int | None) -> ModelBase:
    """A plain HF folder's filled model of shape `cfg` (its config as read_hf_config read it, a vision-language
    model's vision settings as its image processor's limits keep them): each tensor read, cast and assigned once (an
    8B model never exists twice in memory). Raises ValueError (architecture, config field, tensor names; NaN/Inf
    weights)."""
    with torch.device("meta"):
        llama = build_model(cfg, max_positions)
    fill_model(llama, {name: w.to(device=device) for name, w in iter_hf_state(path, cfg, dtype)}, dtype, device)
    return llama


def _load_gguf(path: str, dtype: torch.dtype, device: torch.device,
               max_positions: int | None) -> tuple[ModelConfig, ModelBase]:
    """A GGUF file's config and filled model, its weights dequantized to `dtype` through the weights cache
    (engine.loading.weights_cache.read_gguf_state: the first load writes the entry, later ones read it in a
    fraction of a second; TOKENMILL_WEIGHTS_CACHE=0 turns it off). Raises ValueError for an unsupported
    architecture or missing tensors."""
    cfg, state = read_gguf_state(path, dtype)
    with torch.device("meta"):
        llama = build_model(cfg, max_positions)
    fill_model(llama, {name: w.to(device=device) for name, w in state.items()}, dtype, device)
    return cfg, llama


def _load_quantized(path: str, name: str, dtype: torch.dtype, device: torch.device, quantization: str,
                    group_size: int, max_positions: int | None, int4_layout: Int4Layout,
                    tokenizer: bool) -> OpenedModel:
    """A tokenmill folder, a quantized HF folder, or any model under a mode but "none": its (partly) quantized state
    (read_model_state) built through the held forms (engine.quant.handler.build_model); "int8" then through the INT8
    W8A8 form's from-float step (Int8W8A8Form.from_float_model: fused, smoothed by SmoothQuant, quantized).
    Raises ValueError as open_model."""
    if os.path.isdir(path) and not is_model_folder(path) and not is_hf_folder(path):
        raise ValueError(f"{path} is a folder but neither a Hugging Face model folder (config.json + safetensors) "
                         "nor a tokenmill model folder; pass a GGUF file or one of those folders")
    if is_hf_folder(path):
        hf_cfg = read_hf_config(path)
        if problem := quantization_problem(hf_cfg.architecture, quantization):
            raise ValueError(f"{path}: {problem}")
        if hf_cfg.vision is not None:
            raise ValueError(f"{path}: a quantized vision-language ({hf_cfg.architecture}) folder is not read by "
                             "tokenmill yet; use the unquantized checkpoint with --quantization none")
    if quantization == "int8" and device.type != "cpu":
        raise ValueError(f"quantization='int8' runs on the CPU (oneDNN), not {device.type}; on a GPU use "
                         "'auto' or 'int4'")
    if quantization == "int8" and not tokenizer:
        raise ValueError("quantization='int8' calibrates on text (SmoothQuant): open the model with tokenizer=True")
    cfg, state, loaded = read_model_state(path, quantization, group_size, plain_dtype=dtype, device=device)
    n_int4 = sum(held_form_of(v) in (Int4GroupForm, StackedInt4Form) for v in state.values())
    layout = None
    if n_int4:  # the INT4 modules' layout: given, or chosen for this model (engine.worker.memory_fit)
        layout = int4_layout if isinstance(int4_layout, str) else int4_layout(cfg, handler.held_tensors(cfg, state))
        if device.type == "cuda":
            log.info("INT4 layout %s: %s packed copies of each INT4 weight on %s", layout,
                     "two (tinygemm for small batches beside GemLite)" if layout == "dual" else "one (GemLite)", device)
    llama = handler.build_model(cfg, state, dtype, device, max_positions, int4_layout=layout or "dual")
    tok = Tokenizer.from_model_path(path) if tokenizer else None
    if quantization == "int8" and loaded is None:  # a W8A8 folder's INT8 layers are its stored ones
        from engine.quant.smoothquant import CALIBRATION_TEXT

        Int8W8A8Form.from_float_model(llama, torch.tensor(tok.encode(CALIBRATION_TEXT), dtype=torch.int64,
                                                          device=device))
    if loaded is None and n_int4 and quantization == "auto" and not os.path.isdir(path):
        loaded = f"gguf: {n_int4} weights INT4 as stored, the others dequantized exactly"
    return OpenedModel(cfg, llama, tok, name, loaded, path, num_int4_modules=n_int4, int4_layout=layout)


def model_name(model: str | None) -> str:
    """The name `open_model` (hence LLMEngine.model_name) gives `model`, found without loading or copying it: a URL's
    last path segment, a local file's or folder's base name, a hub id's snapshot folder (or its one GGUF) in the
    local cache, the default model's file name. Raises FileNotFoundError as resolve_model_path does (a local path
    or hub id that is not there)."""
    if model is not None and is_url(model):
        return url_model_name(model)
    return os.path.basename(os.path.normpath(resolve_model_path(model)))
