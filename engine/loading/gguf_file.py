"""GGUF files: the config from their metadata and the tensors under our parameter names (Q/K rows un-permuted),
through the architecture registry; every tensor placed or an error.

GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (read with the `gguf` package's GGUFReader;
ggml lists shapes fastest-dimension first, the reverse of torch, and `gguf.quants.dequantize` returns arrays in
torch order).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.kernels.gguf_blocks import SUPPORTED_TYPES as GGUF_BLOCK_TYPES
from engine.kernels.gguf_blocks import GGUFBlocks
from engine.loading.gguf_int4 import gguf_q4_to_int4, is_native_int4
from engine.loading.gguf_rope import ROPE_TENSORS, gguf_rope_scaling
from engine.loading.gpt_oss_tensors import dequantize_gguf_mxfp4
from engine.model.architectures import get_architecture, gguf_architecture, hf_to_gguf_names
from engine.model.tensor_names import EMBEDDING, check_tensor_names, fuse_names, model_param_names, split_fused
from engine.quant.qparams import Int4Weight
from engine.quant.state import LM_HEAD, is_linear_weight

log = logging.getLogger(__name__)


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
    """A GGUFReader tensor of any type gguf-py reads (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants Q2_K ... Q6_K, IQ*,
    MXFP4) as float32 in torch order ([rows, row length]; 1-D tensors stay 1-D, a mixture-of-experts layer's stacked
    experts [E, rows, row length]), by `gguf.quants.dequantize` (MXFP4: engine.loading.gpt_oss_tensors'
    bit-equal `dequantize_gguf_mxfp4`, 2.5x faster) over chunks of rows, run on a few threads (numpy releases the GIL
    in its array operations). Bit-equal to one `dequantize(tensor.data, tensor.tensor_type)` call: ggml types
    quantize rows block by block, and gguf-py dequantizes each block on its own. Measured (AMD EPYC, 1 thread, 4096 x
    4096): Q4_K 0.44 s whole vs 0.11 s in 1M-weight chunks, Q5_K 0.53 vs 0.18 s, Q6_K 0.24 vs 0.14 s.

    Raises ValueError naming the tensor and its type when gguf-py cannot dequantize that type.
    """
    data = tensor.data
    row_len = int(tensor.shape[0])  # ggml order: the row length first
    per_chunk = max(1, _DEQUANT_CHUNK // row_len)
    if data.ndim < 2:
        return _dequantize_rows(tensor, data)
    rows = data.reshape(-1, data.shape[-1])  # stacked experts: their rows one after another
    if rows.shape[0] <= per_chunk:
        return _dequantize_rows(tensor, rows).reshape(*data.shape[:-1], row_len)
    out = np.empty((rows.shape[0], row_len), dtype=np.float32)
    out[:per_chunk] = _dequantize_rows(tensor, rows[:per_chunk])  # an unreadable type fails here, on one thread

    def fill(start: int) -> None:
        out[start:start + per_chunk] = _dequantize_rows(tensor, rows[start:start + per_chunk])

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(per_chunk, rows.shape[0], per_chunk)))
    return out.reshape(*data.shape[:-1], row_len)


def _dequantize_rows(tensor: Any, data: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type == GGMLQuantizationType.MXFP4:
        return dequantize_gguf_mxfp4(data)
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


def _arch_field(reader: object, arch: str, key: str, default: object) -> object:
    """The metadata value `{arch}.{key}`, or `default`."""
    return _field(reader, f"{arch}.{key}", default)


def _token_ids(reader: object, texts: tuple[str, ...]) -> list[int]:
    """The ids of the tokens spelled `texts` in the file's vocabulary (`tokenizer.ggml.tokens`), those it has."""
    if not texts:
        return []
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return [i for i, token in enumerate(tokens) if token in texts]  # type: ignore[attr-defined]


def read_gguf_config(reader: object) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.block_count`, `{arch}.embedding_length`, ...) through the
    architecture's registry entry (engine.model.architectures): QKV bias and q/k norms by family, RoPE scaling from
    `{arch}.rope.scaling.*` or, for Llama 3, the `rope_freqs.weight` factors llama.cpp's converter writes, every stop
    token (EOS, EOT, EOM ids, and the family's end-of-generation tokens by text: Architecture.gguf_stop_tokens).

    Raises ValueError for an architecture we do not run (listing those we do) or a RoPE scaling, expert router or
    family field (engine.model.family_fields) we do not implement, naming it.
    """
    arch = str(_field(reader, "general.architecture"))
    entry = gguf_architecture(arch, bool(_field(reader, f"{arch}.expert_count", 0)))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)  # type: ignore[attr-defined]
    tensors = {t.name: t for t in reader.tensors}  # type: ignore[attr-defined]
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if not head_dim and "partial_rotary_factor" not in entry.reads:  # else rope.dimension_count is the rotated part
        head_dim = _field(reader, f"{arch}.rope.dimension_count")
    max_pos = int(_field(reader, f"{arch}.context_length", 2048))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    stops = tuple(dict.fromkeys(int(i) for i in (eos, _field(reader, "tokenizer.ggml.eot_token_id"),
                                                 _field(reader, "tokenizer.ggml.eom_token_id"),
                                                 *_token_ids(reader, entry.gguf_stop_tokens)) if i is not None))
    window = _field(reader, f"{arch}.attention.sliding_window")
    if arch == "llama" and not window:
        _warn_mistral_without_window(str(_field(reader, "general.name") or ""),
                                     str(_field(reader, "general.basename") or ""))
    get = functools.partial(_arch_field, reader, arch)
    fields = {} if entry.gguf_fields is None else entry.gguf_fields(
        get, layers=int(_field(reader, f"{arch}.block_count")), hidden=hidden, heads=heads,
        head_dim=int(head_dim) if head_dim else hidden // heads)
    return ModelConfig(**{**dict(
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
        rope_scaling=gguf_rope_scaling(get, tensors, max_pos, entry.gguf_yarn_truncate),
        eos_token_ids=stops,
        sliding_window=int(window) if window else None,
        **_gguf_experts(reader, arch, entry),
    ), **fields})


@functools.cache
def _warn_mistral_without_window(name: str, basename: str) -> None:
    """Warn, once per model name, when a llama GGUF names a Mistral model but has no sliding-window key.

    llama.cpp's convert_hf_to_gguf.py writes Mistral as architecture "llama" without `llama.attention.sliding_window`,
    so such a file runs with full attention. Only the name in its metadata (general.name / general.basename) says
    it came from Mistral: whether its Hugging Face config had a window (Mistral 7B v0.1: 4096; v0.2 and later: none)
    is not in the file, so the warning says what follows in either case."""
    if not re.search(r"mistral", f"{name} {basename}", re.IGNORECASE):
        return
    log.warning("the GGUF %r names a Mistral model but holds no sliding window (llama.cpp's converter writes none): "
                "it runs with full attention. Where the Hugging Face config has a window (Mistral 7B v0.1: 4096 "
                "tokens), sequences longer than the window differ from Hugging Face's; load the Hugging Face folder "
                "to keep it", name or basename)


def _gguf_experts(reader: object, arch: str, entry: Any) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from `{arch}.expert_*` metadata ({} for a dense entry), as llama.cpp
    reads them: the expert width from expert_feed_forward_length (else feed_forward_length, as Mixtral's files
    have), the renormalisation from expert_weights_norm (else llama.cpp's default for the architecture,
    Architecture.gguf_norm_topk). Raises ValueError for a gating function the family's router does not compute
    (Architecture.gguf_gating), a scale of the experts' weights (expert_weights_scale other than 0 or 1) or shared
    experts the family has not."""
    if entry.router is None:
        return {}
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating not in entry.gguf_gating:
        raise ValueError(f"GGUF {arch}.expert_gating_func={gating} is not implemented for {entry.name}; its router "
                         f"({entry.router}) is llama.cpp's expert_gating_func {entry.gguf_gating[-1]}")
    scale = _field(reader, f"{arch}.expert_weights_scale")
    if scale not in (None, 0, 1):  # llama.cpp multiplies the routing weights by it unless 0 or 1
        raise ValueError(f"GGUF {arch}.expert_weights_scale={scale} is not implemented; tokenmill scales the "
                         "experts' routing weights by 1")
    shared = int(_field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0) if entry.shared_expert else 0
    if entry.shared_expert and not shared:
        raise ValueError(f"GGUF {arch} file lacks {arch}.expert_shared_feed_forward_length")
    norm = _field(reader, f"{arch}.expert_weights_norm")
    width = _field(reader, f"{arch}.expert_feed_forward_length") or _field(reader, f"{arch}.feed_forward_length")
    return dict(num_experts=int(_field(reader, f"{arch}.expert_count")),
                num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 0)),
                moe_intermediate_size=int(width), router=entry.router, shared_expert_intermediate_size=shared,
                norm_topk_prob=entry.router == "softmax_topk" and bool(entry.gguf_norm_topk if norm is None else norm))


def gguf_name_map(reader: Any, cfg: ModelConfig) -> dict[str, str]:
    """{GGUF tensor name: our parameter name} for every tensor of the file but the RoPE factors (`rope_freqs`,
    `rope_factors_*`: read into cfg.rope_scaling), checked: Raises ValueError naming a tensor the architecture does
    not place, or a missing one. Families with fused projections (Phi-3) map attn_qkv / ffn_up to their fused
    names (qkv_proj, gate_up_proj: split when read)."""
    entry = get_architecture(cfg.architecture)
    names = model_param_names(cfg) + ([] if cfg.tie_word_embeddings else [f"{LM_HEAD}.weight"])
    table = hf_to_gguf_names(entry, fuse_names(names) if entry.fused_projections else names, cfg.num_layers)
    out = {}
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue
        if t.name not in table:
            raise ValueError(f"GGUF tensor {t.name!r} is not part of the {cfg.architecture} architecture as tokenmill "
                             "runs it; tokenmill would drop it and compute something else")
        out[t.name] = table[t.name]
    check_tensor_names(out.values(), cfg, "the GGUF file", fused=entry.fused_projections)
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
        if name is None:  # RoPE factors, already in cfg.rope_scaling
            continue
        shape = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else None  # ggml: fastest dimension first
        if native_int4 and is_linear_weight(name) and is_native_int4(t.tensor_type.name):
            w = gguf_q4_to_int4(t.data, t.tensor_type.name, shape)
            for part, rows in split_fused(name.removesuffix(".weight"), w, cfg):
                yield part, rows.map_rows(lambda x, n=part: unpermute_qk(n, x, cfg))
            continue
        w = np.asarray(dequantize_tensor(t), dtype=np.float32)
        if cfg.norm_weight_offset and name.endswith("norm.weight"):
            w = w - np.float32(cfg.norm_weight_offset)  # llama.cpp's converter stored (offset + weight)
        for part, rows in split_fused(name, w, cfg):
            yield part, torch.from_numpy(np.array(unpermute_qk(part, rows, cfg), dtype=np.float32, copy=True))
        # The embedding's blocks only serve a tied LM head (an untied embedding is a lookup, never a GEMM).
        if keep_blocks and t.tensor_type.name in GGUF_BLOCK_TYPES and (
                is_linear_weight(name) or (cfg.tie_word_embeddings and name == f"{EMBEDDING}.weight")):
            blocks = GGUFBlocks.from_raw(t.data, t.tensor_type.name, shape)
            for part, rows in split_fused(name.removesuffix(".weight"), blocks, cfg):
                yield from rows.map_rows(lambda x, n=part: unpermute_qk(n, x, cfg)).to_state(part).items()
