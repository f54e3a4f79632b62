"""Load a model: build it on the meta device and fill it from a GGUF file (through the weights cache) or an HF
folder. The formats' readers: engine.loading.gguf_file, engine.loading.hf_folder; where the model is:
engine.loading.model_files.

The one GGUF reading path: the plain load here (LLMEngine's default) and the quantized loads and folders of
engine.loading.quantized both read tensors with `iter_gguf_state` and fill the meta-device model with
engine.model.fill.fill_model.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kernels.gguf_blocks import is_block_key
from engine.loading.gguf_file import iter_gguf_state, read_gguf_config
from engine.loading.hf_folder import is_hf_folder as is_hf_folder  # NOTE: re-exported for engine.llm_engine
from engine.loading.hf_folder import iter_hf_state, read_hf_config
from engine.loading.model_files import (
    resolve_model_path as resolve_model_path,  # NOTE: re-exported for engine.llm_engine
)
from engine.loading.weights_cache import (
    read_weights_cache,
    weights_cache_dir,
    weights_cache_enabled,
    write_weights_cache,
)
from engine.model.base import ModelBase
from engine.model.fill import fill_model
from engine.model.registry import build_model
from engine.model.tensor_names import LM_HEAD


def read_gguf_state(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the dequantized weights in `dtype` (CPU tensors under their HF names, a tied LM head left
    out) of the GGUF file at `path`, through the weights cache (`load_gguf_model`; TOKENMILL_WEIGHTS_CACHE=0 turns
    it off): read from the cache entry when there is one, else from the file, and the entry written. For fp32 the
    state also holds the raw GGUF blocks of the block-quantized weights (`is_block_key` entries; `fill_model`
    attaches them to their modules)."""
    folder = weights_cache_dir(path, dtype) if weights_cache_enabled() else None
    cached = read_weights_cache(folder) if folder is not None else None
    if cached is not None:
        return cached
    from engine.loading.gguf_file import open_gguf

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


def load_gguf_model(path: str, dtype: torch.dtype, device: torch.device,
                    max_positions: int | None = None) -> tuple[ModelConfig, ModelBase]:
    """Read a GGUF file and return its config and a filled model (engine.model.registry.build_model) in `dtype`
    on `device`.

    Reading a GGUF file costs seconds per process (GGUFReader parses every metadata field, the tokenizer's 49k
    strings included, then every tensor is dequantized on the CPU), and every Dask worker pays it at start-up. So
    the first load also writes the dequantized weights in `dtype` with the config as a safetensors file under
    $TOKENMILL_CACHE_DIR/weights (`weights_cache_dir`; keyed by the file's path, size, modification time, the
    dtype and torch's version; about 2 bytes per parameter in bf16), and later loads read that instead: a fraction
    of a second (engine.loading.quantized's plain loads, quantization "none" and "int8", read the fp32 entry too).
    TOKENMILL_WEIGHTS_CACHE=0 turns the cache off.
    The model is built on the meta device and each tensor is assigned once, so weights never exist twice.
    Raises ValueError for unsupported architectures or missing tensors.
    """
    cfg, state = read_gguf_state(path, dtype)
    with torch.device("meta"):
        model = build_model(cfg, max_positions)
    fill_model(model, {name: w.to(device=device) for name, w in state.items()}, dtype, device)
    return cfg, model


def load_hf_model(path: str, dtype: torch.dtype, device: torch.device, max_positions: int | None = None,
                  config: ModelConfig | None = None) -> tuple[ModelConfig, ModelBase]:
    """Read an HF folder and return its config and a filled model in `dtype` on `device`: built on the meta
    device, each tensor read, cast and assigned once (an 8B model never exists twice in memory). `config`: the
    folder's config as read_hf_config read it, with a vision-language model's vision settings its image processor's
    limits keep (engine.multimodal.processor.ImageProcessor.from_model_path); None reads it. Raises ValueError
    (architecture, config field, tensor names; NaN/Inf weights) before the model is used."""
    cfg = read_hf_config(path) if config is None else config
    with torch.device("meta"):
        model = build_model(cfg, max_positions)
    fill_model(model, {name: w.to(device=device) for name, w in iter_hf_state(path, cfg, dtype)}, dtype, device)
    return cfg, model
