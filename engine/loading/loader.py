"""Load a model: build it on the meta device and fill it from a GGUF file (through the weights cache) or an HF
folder. The formats' readers: engine.loading.gguf_file, engine.loading.hf_folder; where the model is:
engine.loading.model_files.

The one GGUF reading path: the plain load here (LLMEngine's default) and the quantized loads and folders of
engine.loading.quantized both read tensors with `iter_gguf_state` and fill the meta-device model with `fill_model`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kernels.gguf_blocks import GGUFBlocks, is_block_key, set_gguf_blocks
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
from engine.model.decoder import LlamaModel
from engine.model.tensor_names import EMBEDDING
from engine.quant.state import LM_HEAD


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
                    max_positions: int | None = None) -> tuple[ModelConfig, LlamaModel]:
    """Read a GGUF file and return its config and a filled `LlamaModel` in `dtype` on `device`.

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
        model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
    fill_model(model, {name: w.to(device=device) for name, w in state.items()}, dtype, device)
    return cfg, model


def load_hf_model(path: str, dtype: torch.dtype, device: torch.device,
                  max_positions: int | None = None) -> tuple[ModelConfig, LlamaModel]:
    """Read an HF folder and return its config and a filled LlamaModel in `dtype` on `device`: built on the meta
    device, each tensor read, cast and assigned once (an 8B model never exists twice in memory). Raises ValueError
    (architecture, config field, tensor names; NaN/Inf weights) before the model is used."""
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
    fill_model(model, {name: w.to(device=device) for name, w in iter_hf_state(path, cfg, dtype)}, dtype, device)
    return cfg, model


def fill_model(model: LlamaModel, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    """Fill a meta-device model in place with the plain tensors `state` (HF names, cast to `dtype` on `device`),
    assigned without copies, tie a plain LM head to the embedding when the config ties them, rebuild non-persistent
    buffers on `device` and switch to eval. Modules already replaced (INT4) keep their own tensors; a tied
    "lm_head.weight" in `state` is ignored. Raises ValueError naming the tensors the model needs and `state` lacks.
    """
    tied = model.config.tie_word_embeddings
    lm_head = f"{LM_HEAD}.weight"
    blocks = pop_gguf_blocks(state)
    plain = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if not (tied and k == lm_head)}
    expected = {k for k in model.state_dict() if not (tied and k == lm_head)}
    for k, v in plain.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ValueError(f"model tensor {k} holds NaN or Inf values: the model file is damaged; download or "
                             "convert it again")
    missing = expected - set(plain)
    if missing:
        raise ValueError(f"model file lacks tensors {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)")
    model.load_state_dict(plain, strict=False, assign=True)
    if tied and isinstance(model.embed_tokens, nn.Embedding):
        model.tie_weights()
    if device.type == "cpu" and dtype == torch.float32:
        attach_gguf_blocks(model, blocks)
    model.materialize_rotary(device)
    model.eval()


def pop_gguf_blocks(state: dict[str, torch.Tensor]) -> dict[str, GGUFBlocks]:
    """Take the raw GGUF block entries (`is_block_key`) out of `state`, in place: module name -> GGUFBlocks."""
    prefixes = {k.rsplit(".", 1)[0] for k in state if is_block_key(k)}
    found = {p: GGUFBlocks.from_state(p, state) for p in prefixes}
    for k in [k for k in state if is_block_key(k)]:
        del state[k]
    return found


def attach_gguf_blocks(model: LlamaModel, blocks: dict[str, GGUFBlocks]) -> int:
    """Give each plain nn.Linear the GGUF blocks of its weight (`set_gguf_blocks`; the embedding's go to a tied LM
    head, which multiplies by the same matrix). Modules already replaced (INT4) are skipped. Returns how many."""
    attached = 0
    for prefix, b in blocks.items():
        name = LM_HEAD if prefix == EMBEDDING and model.config.tie_word_embeddings else prefix
        module = model.get_submodule(name) if name != EMBEDDING else None
        if type(module) is nn.Linear and set_gguf_blocks(module, b):
            attached += 1
    return attached
