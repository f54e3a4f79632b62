"""GGUF files: the config from their metadata and the tensors under our parameter names (Q/K rows un-permuted),
through the architecture registry; every tensor placed or an error.

GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (read with the `gguf` package's GGUFReader;
ggml lists shapes fastest-dimension first, the reverse of torch, and `gguf.quants.dequantize` returns arrays in
torch order).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig, RopeScaling
from engine.kernels.gguf_blocks import SUPPORTED_TYPES as GGUF_BLOCK_TYPES
from engine.kernels.gguf_blocks import GGUFBlocks
from engine.loading.gguf_int4 import gguf_q4_to_int4, is_native_int4
from engine.model.architectures import ARCHITECTURES, get_architecture, hf_to_gguf_names, supported
from engine.model.tensor_names import EMBEDDING, check_tensor_names, model_param_names
from engine.quant.qparams import Int4Weight
from engine.quant.state import LM_HEAD, is_linear_weight


def open_gguf(path: str) -> Any:
    """A gguf.GGUFReader of the GGUF file at `path` that parses the metadata about 3x faster (SmolLM2-135M: 1.4
    instead of 4.2 CPU-s, the tokenizer's 49k strings and merges being most of it), with the same fields and tensors.

    GGUFReader slices its np.memmap once per metadata value, and each memmap slice runs memmap's Python
    __array_finalize__ and __getitem__; the reader here slices a plain ndarray view of the same mapping (no copy)
    instead. Raises ValueError (one line naming the file and the fix) for a file cut short (a download or conversion
    that stopped early: a metadata value or a tensor's data runs past its end), else what GGUFReader raises (OSError,
    ValueError for a file that is not GGUF).
    """
    import gguf

    try:
        return _fast_reader(gguf.GGUFReader)(path)
    except _TruncatedGGUF as e:
        size = os.path.getsize(path)
        raise ValueError(f"{path} is not a complete GGUF file: it ends at byte {size:,} and its contents run to byte "
                         f"{e.needed:,} at least; download or convert the model again") from None


class _TruncatedGGUF(Exception):
    """A read past the end of the file (GGUFReader itself would fail later with a numpy reshape or struct error)."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


@functools.cache
def _fast_reader(base: type) -> type:
    class FastGGUFReader(base):  # type: ignore[misc,valid-type]
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None or plain.base is not self.data:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            if end > plain.shape[0]:
                raise _TruncatedGGUF(end)
            arr = plain[offset:end].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return FastGGUFReader


#: Weights per dequantize call (`dequantize_tensor`): small enough that gguf-py's temporaries (several fp32 copies of
#: a chunk) stay in the CPU's caches and in bounded memory, large enough that numpy's per-call costs vanish.
_DEQUANT_CHUNK = 1 << 20


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUFReader tensor of any type gguf-py reads (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants Q2_K ... Q6_K, IQ*)
    as float32 [rows, row length] (torch order; 1-D tensors stay 1-D), by `gguf.quants.dequantize` over chunks of
    rows, run on a few threads (numpy releases the GIL in its array operations). Bit-equal to one
    `dequantize(tensor.data, tensor.tensor_type)` call: ggml types quantize rows block by block, and gguf-py
    dequantizes each block on its own. Measured (AMD EPYC, 1 thread, 4096 x 4096): Q4_K 0.44 s whole vs 0.11 s in
    1M-weight chunks, Q5_K 0.53 vs 0.18 s, Q6_K 0.24 vs 0.14 s.

    Raises ValueError naming the tensor and its type when gguf-py cannot dequantize that type.
    """
    from gguf.quants import dequantize

    data, qtype = tensor.data, tensor.tensor_type
    row_len = int(tensor.shape[0])  # ggml order: the row length first
    per_chunk = max(1, _DEQUANT_CHUNK // row_len)
    if data.ndim < 2 or data.shape[0] <= per_chunk:
        return _dequantize_one(tensor, data)
    out = np.empty((data.shape[0], row_len), dtype=np.float32)
    out[:per_chunk] = _dequantize_one(tensor, data[:per_chunk])  # an unreadable type fails here, on one thread

    def fill(start: int) -> None:
        out[start:start + per_chunk] = dequantize(data[start:start + per_chunk], qtype)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(per_chunk, data.shape[0], per_chunk)))
    return out


def _dequantize_one(tensor: Any, data: np.ndarray) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which the gguf package "
                         "cannot dequantize; convert the model to another type (Q4_K_M, Q8_0, F16)") from None


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
    architecture's registry entry (engine.model.architectures): QKV bias and q/k norms by family, RoPE scaling from
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
        factors = dequantize_tensor(rope_freqs).reshape(-1)
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


def iter_gguf_state(reader: Any, cfg: ModelConfig, native_int4: bool = False,
                    keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """(name, value) per model tensor of a GGUF file, Q/K rows un-permuted: fp32 CPU tensors [out, in] (torch order,
    dequantized by `dequantize_tensor`) under their HF parameter names; with `native_int4`, the 4-bit projection
    weights gguf_int4.NATIVE_INT4_TYPES map exactly (Q4_0, Q4_1, Q4_K) instead as
    Int4Weight under their module name (packed rows and scales un-permuted alike; engine.loading.gguf_int4). With
    `keep_blocks`, each projection, LM head or tied embedding weight stored in a GGUF_BLOCK_TYPES type also comes as its
    raw blocks (engine.kernels.gguf_blocks.GGUFBlocks.to_state entries `{module}.gguf_*`, after the fp32 weight): the
    CPU's small-batch kernel reads those (engine.quant.packed_linear)."""
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
            w = unpermute_qk(name, dequantize_tensor(t), cfg)
            yield name, torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else np.array(w, copy=True))
            # The embedding's blocks only serve a tied LM head (an untied embedding is a lookup, never a GEMM).
            if keep_blocks and t.tensor_type.name in GGUF_BLOCK_TYPES and (
                    is_linear_weight(name) or (cfg.tie_word_embeddings and name == f"{EMBEDDING}.weight")):
                shape = (int(t.shape[1]), int(t.shape[0]))
                blocks = GGUFBlocks.from_raw(t.data, t.tensor_type.name, shape)
                blocks = blocks.map_rows(lambda x, n=name: unpermute_qk(n, x, cfg))
                yield from blocks.to_state(name.removesuffix(".weight")).items()
