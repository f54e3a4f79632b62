"""GGUF files: the config from their metadata (engine.loading.gguf_config) and the tensors under our parameter names
(Q/K rows un-permuted), through the architecture registry; every tensor placed or an error.

GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (read with the `gguf` package's GGUFReader;
ggml lists shapes fastest-dimension first, the reverse of torch, and `gguf.quants.dequantize` returns arrays in
torch order).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.kernels.gguf_blocks import SUPPORTED_TYPES as GGUF_BLOCK_TYPES
from engine.kernels.gguf_blocks import GGUFBlocks
from engine.loading.gguf_config import gguf_name_map
from engine.loading.gguf_config import read_gguf_config as read_gguf_config  # NOTE: re-exported (loader, quantized)
from engine.loading.gguf_header import string_starts
from engine.loading.gguf_int4 import gguf_q4_to_int4
from engine.loading.gguf_native_int4 import loads_as_native_int4
from engine.loading.gpt_oss_tensors import dequantize_gguf_mxfp4
from engine.model.architectures import get_architecture
from engine.model.tensor_names import EMBEDDING, split_fused
from engine.quant.qparams import Int4Weight
from engine.quant.stacked_int4 import StackedInt4
from engine.quant.state import is_expert_weight, is_linear_weight


def open_gguf(path: str) -> Any:
    """A gguf.GGUFReader of the GGUF file at `path` that parses the metadata faster (the tokenizer's strings and
    merges being most of it; bench/README.md "Figures once quoted in engine/'s docstrings"), with the same fields
    and tensors.

    GGUFReader slices its np.memmap once per metadata value, and each memmap slice runs memmap's Python
    __array_finalize__ and __getitem__; the reader here slices a plain ndarray view of the same mapping (no copy)
    instead, and reads an array of strings or scalars (the vocabulary, its merges and token types) in one loop rather
    than one `_get_field_parts` call per element (the same parts: a view each). Raises ValueError (one line naming the
    file and the fix) for a file cut short (a download or conversion that stopped early: a metadata value or a tensor's
    data runs past its end), else what GGUFReader raises (OSError, ValueError for a file that is not GGUF).
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

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list]:
            # An array of strings or scalars (the vocabulary, merges, token types: most of a file's metadata) in one
            # pass: the parts GGUFReader makes one `_get_field_parts` call each, views of the same bytes
            from gguf import GGUFValueType

            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, count, offs = GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
            scalar = self.gguf_scalar_to_np.get(itype)
            if itype == GGUFValueType.STRING:
                parts = _string_parts(self.__dict__["_plain"], offs, count)
            elif scalar is not None and count:
                whole = self._get(offs, scalar, count)
                parts = [whole[i:i + 1] for i in range(count)]
            else:
                return super()._get_field_parts(orig_offs, raw_type)
            size = 12 + sum(int(part.nbytes) for part in parts)
            step = 2 if itype == GGUFValueType.STRING else 1
            return size, [raw_itype, alen, *parts], list(range(1 + step, 2 + len(parts), step)), \
                [GGUFValueType.ARRAY, itype] if count else [GGUFValueType.ARRAY]

    return FastGGUFReader


def _string_parts(plain: np.ndarray, offs: int, count: int) -> list[np.ndarray]:
    """GGUF strings (uint64 length, UTF-8 bytes) from byte `offs` of `plain`: [length, bytes] views per string, as
    GGUFReader._get_str returns them (native byte order). Raises _TruncatedGGUF where one runs past the end."""
    try:
        starts = string_starts(plain, offs, count, sys.byteorder)
    except EOFError as e:
        raise _TruncatedGGUF(e.args[0]) from None
    u64, parts = np.dtype(np.uint64).newbyteorder("I"), []
    for start, end in itertools.pairwise(starts):
        parts += [plain[start:start + 8].view(u64), plain[start + 8:end]]
    return parts


#: Weights per dequantize call (`dequantize_tensor`): small enough that gguf-py's temporaries (several fp32 copies of
#: a chunk) stay in the CPU's caches and in bounded memory, large enough that numpy's per-call costs vanish.
_DEQUANT_CHUNK = 1 << 20


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A GGUFReader tensor of any type gguf-py reads (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants Q2_K ... Q6_K, IQ*,
    MXFP4) as float32 in torch order ([rows, row length]; 1-D tensors stay 1-D, a mixture-of-experts layer's stacked
    experts [E, rows, row length]), by `gguf.quants.dequantize` (MXFP4: engine.loading.gpt_oss_tensors'
    bit-equal `dequantize_gguf_mxfp4`, faster) over chunks of rows, run on a few threads (numpy releases the GIL
    in its array operations). Bit-equal to one `dequantize(tensor.data, tensor.tensor_type)` call: ggml types
    quantize rows block by block, and gguf-py dequantizes each block on its own. Chunks are faster than one whole
    call even on one thread (bench/README.md "Checkpoints, families and the job's edges").

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
                    keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | Int4Weight | StackedInt4]]:
    """(name, value) per model tensor of a GGUF file, Q/K rows un-permuted: fp32 CPU tensors [out, in] (torch order,
    dequantized by `dequantize_tensor`) under their HF parameter names; with `native_int4`, the 4-bit projection
    weights gguf_native_int4.NATIVE_INT4_TYPES map exactly (Q4_0, Q4_1, Q4_K) instead as
    Int4Weight under their module name (packed rows and scales un-permuted alike; engine.loading.gguf_int4). With
    `keep_blocks`, each projection, LM head or tied embedding weight stored in a GGUF_BLOCK_TYPES type also comes as its
    raw blocks (engine.kernels.gguf_blocks.GGUFBlocks.to_state entries `{module}.gguf_*`, after the fp32 weight): the
    CPU's small-batch kernel reads those (engine.quant.packed_linear). A mixture-of-experts layer's stacked experts
    [E, N, K] alike: StackedInt4 [E, N, Kp/2] (native_int4), blocks of [E * N, K] (keep_blocks)."""
    names = gguf_name_map(reader, cfg)  # every tensor placed, before any is read
    for t in reader.tensors:
        name = names.get(t.name)
        if name is None:  # RoPE factors, already in cfg.rope_scaling
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
        experts = is_expert_weight(name)  # [E, N, K]: its blocks as those of [E * N, K]
        if native_int4 and loads_as_native_int4(name, t.tensor_type.name):
            w = gguf_q4_to_int4(t.data, t.tensor_type.name, shape)
            for part, rows in split_fused(name.removesuffix(".weight"), w, cfg):
                yield part, rows if experts else rows.map_rows(lambda x, n=part: unpermute_qk(n, x, cfg))
            continue
        w = np.asarray(dequantize_tensor(t), dtype=np.float32)
        if cfg.norm_weight_offset and name.endswith("norm.weight"):
            w = w - np.float32(cfg.norm_weight_offset)  # llama.cpp's converter stored (offset + weight)
        for part, rows in split_fused(name, w, cfg):
            yield part, torch.from_numpy(np.array(unpermute_qk(part, rows, cfg), dtype=np.float32, copy=True))
        # The embedding's blocks only serve a tied LM head (an untied embedding is a lookup, never a GEMM).
        if keep_blocks and t.tensor_type.name in GGUF_BLOCK_TYPES and (
                is_linear_weight(name) or experts or (cfg.tie_word_embeddings and name == f"{EMBEDDING}.weight")):
            blocks = GGUFBlocks.from_raw(t.data, t.tensor_type.name, (math.prod(shape[:-1]), shape[-1]))
            if experts:
                yield from blocks.to_state(name.removesuffix(".weight")).items()
                continue
            for part, rows in split_fused(name.removesuffix(".weight"), blocks, cfg):
                yield from rows.map_rows(lambda x, n=part: unpermute_qk(n, x, cfg)).to_state(part).items()
