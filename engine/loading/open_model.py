"""Which loader reads a model: a plain Hugging Face folder or GGUF file through engine.loading.loader (the GGUF
through the weights cache), anything quantized or a tokenmill folder through engine.loading.quantized. What
LLMEngine.from_model loads its weights and tokenizer with."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from engine.config import ModelConfig
from engine.loading.gguf_native_int4 import gguf_dequantized_note
from engine.loading.hf_folder import hf_quant_format, read_hf_config
from engine.loading.loader import is_hf_folder, load_gguf_model, load_hf_model, resolve_model_path
from engine.loading.model_files import is_url, url_model_name
from engine.model.base import ModelBase
from engine.model.registry import quantization_problem
from engine.multimodal.processor import ImageProcessor
from engine.text.tokenizer import Tokenizer


class OpenedModel(NamedTuple):
    """A filled model on its device, its shape, its tokenizer, the model's name (its file or folder name), for an
    already quantized HF folder or GGUF file how its layers were loaded (engine.loading.quantized.LoadedModel.
    quantization_loaded; for a quantized GGUF under "none", engine.loading.gguf_native_int4.gguf_dequantized_note;
    None otherwise), the local path it was read from (its sentence-transformers files: engine.pooling) and, for a
    vision-language model, its image processor (engine.multimodal.processor; None otherwise)."""

    model: ModelBase
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    quantization_loaded: str | None = None
    path: str = ""
    image_processor: ImageProcessor | None = None


def open_model(model: str | None, dtype: torch.dtype, device: torch.device, *, quantization: str = "none",
               group_size: int = 128, max_positions: int | None = None,
               int4_layout: str | Callable[[ModelConfig, list[tuple[int, int | None]]], str] = "dual",
               image_pixels: tuple[int | None, int | None] = (None, None)) -> OpenedModel:
    """Load `model` (a GGUF path or fsspec URL, a Hugging Face model folder, a tokenmill folder; None = the default
    SmolLM2-135M-Instruct Q4_1) onto `device` in `dtype` with the given quantization (EngineConfig.quantization,
    int4_group_size; engine.loading.quantized's modes; int4_layout: as engine.loading.quantized.load_model).
    `image_pixels`: a vision-language model's (max, min) pixels per image (EngineConfig.max_image_pixels,
    min_image_pixels), through its image processor (engine.multimodal.pixel_limits; a text-only model ignores them).
    Raises FileNotFoundError (no such model), ValueError (unsupported architecture, bad mode, broken file, pixel
    limits the image processor cannot honour)."""
    path = resolve_model_path(model)
    name = _path_name(path)
    if quantization == "none" and is_hf_folder(path) and hf_quant_format(path) is None:
        cfg = read_hf_config(path)
        images = None if cfg.vision is None else ImageProcessor.from_model_path(path, cfg.vision, *image_pixels)
        if images is not None and images.vision != cfg.vision:  # LLaVA-NeXT's pinpoints the limits keep
            cfg = replace(cfg, vision=images.vision)
        cfg, llama = load_hf_model(path, dtype, device, max_positions=max_positions, config=cfg)
        tokenizer = Tokenizer.from_model_path(path)
        if images is not None and not tokenizer.has_chat_template and images.chat_template:
            tokenizer.use_chat_template(images.chat_template)  # a processor's chat_template.json / .jinja
        return OpenedModel(llama, cfg, tokenizer, name, path=path, image_processor=images)
    if quantization != "none" or os.path.isdir(path):
        from engine.loading.quantized import load_model

        if is_hf_folder(path):
            hf_cfg = read_hf_config(path)
            if problem := quantization_problem(hf_cfg.architecture, quantization):
                raise ValueError(f"{path}: {problem}")
            if hf_cfg.vision is not None:
                raise ValueError(f"{path}: a quantized vision-language ({hf_cfg.architecture}) folder is not read by "
                                 "tokenmill yet; use the unquantized checkpoint with --quantization none")

        loaded = load_model(path, dtype, device, quantization=quantization, group_size=group_size,
                            max_positions=max_positions, int4_layout=int4_layout)
        return OpenedModel(loaded.model, loaded.config, loaded.tokenizer, name, loaded.quantization_loaded, path)
    cfg, llama = load_gguf_model(path, dtype, device, max_positions=max_positions)
    note = gguf_dequantized_note(path, str(dtype).removeprefix("torch."))  # summary: "none" dequantized Q4_1 weights
    return OpenedModel(llama, cfg, Tokenizer.from_gguf(path), name, note, path)


def _path_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path))


def model_name(model: str | None) -> str:
    """The name `open_model` (hence LLMEngine.model_name) gives `model`, found without loading or copying it: a URL's
    last path segment, a local file's or folder's base name, a hub id's snapshot folder (or its one GGUF) in the
    local cache, the default model's file name. Raises FileNotFoundError as resolve_model_path does (a local path
    or hub id that is not there)."""
    if model is not None and is_url(model):
        return url_model_name(model)
    return _path_name(resolve_model_path(model))
