"""Tiny Llama GGUF files in the tensor types llama.cpp's quantized files hold (issue 42), for the loader's tests.

llama.cpp's mixes (llama-quant.cpp `llama_tensor_get_type`): Q4_K_M keeps most projections in Q4_K and (some of)
attn_v, ffn_down and the output in Q6_K; Q5_K_M the same with Q5_K; Q6_K and Q8_0 files hold one type; tensors whose
rows are not whole 256-weight super-blocks fall back to Q5_0 / Q5_1 / Q8_0, and F16 / BF16 files keep 16-bit weights.
Types gguf-py quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16) are written by `gguf.quants.quantize` from normal
weights; gguf-py has no K-quant quantizer, so Q4_K / Q5_K / Q6_K blocks are random integers, scales and mins (the
block layouts of ggml-common.h `block_q4_K`, `block_q5_K`, `block_q6_K`, as gguf-py's quants.py reads them) with
finite fp16 super-block scales sized for weights of about `std`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

gguf = __import__("gguf")
T = gguf.GGMLQuantizationType

#: The shape of the tiny model: every row a whole number of 256-weight super-blocks, so each type fits every tensor.
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2

#: GGUF tensor role -> type (or one type per layer), per file. "Q4_K_M" is llama.cpp's mix; "every-other-type" holds
#: the other types of Q5_K_M, Q6_K, Q8_0, F16 and BF16 files and the Q5_0 / Q5_1 fallbacks, each on some projection.
MIXES: dict[str, dict[str, object]] = {
    "Q4_K_M": {"token_embd": T.Q4_K, "output": T.Q6_K, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K,
               "attn_output": T.Q4_K, "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K},
    "every-other-type": {"token_embd": T.Q5_K, "output": T.Q8_0, "attn_q": (T.Q5_K, T.Q5_1),
                         "attn_k": (T.Q5_0, T.Q5_K), "attn_v": (T.Q5_1, T.Q8_0), "attn_output": (T.Q8_0, T.Q5_0),
                         "ffn_gate": (T.F16, T.BF16), "ffn_up": (T.BF16, T.Q5_K), "ffn_down": (T.Q6_K, T.F16)},
}

# (offset of fp16 d, offset of fp16 dmin or None, d's standard deviation per unit of weight std): the K-quants' fp16
# fields (gguf-py quants.py Q4_K / Q5_K / Q6_K dequantize_blocks); the rest of a block is random bytes. A weight is
# d * sc * q - dmin * m (sc, m in 0..63; q 0..15 or 0..31) or, for Q6_K, d * sc * (q - 32) (sc int8, q 0..63).
_K_FIELDS = {T.Q4_K: (0, 2, 1 / 250), T.Q5_K: (0, 2, 1 / 500), T.Q6_K: (208, None, 1 / 1400)}


def random_tensor(qtype: object, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """A [rows, cols] weight in GGUF type `qtype`: raw uint8 [rows, row bytes] for block types, float32 for F32.

    Raises ValueError for a type neither gguf-py quantizes nor `_K_FIELDS` describes."""
    if qtype in _K_FIELDS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        d_at, dmin_at, per_std = _K_FIELDS[qtype]
        nsb = rows * cols // block
        raw = rng.integers(0, 256, size=(nsb, size), dtype=np.uint8)
        raw[:, d_at:d_at + 2] = rng.normal(0, std * per_std, nsb).astype(np.float16).view(np.uint8).reshape(nsb, 2)
        if dmin_at is not None:  # mins of either sign across super-blocks: weights about zero-mean overall
            dmin = rng.normal(0, std * per_std * 3, nsb).astype(np.float16)
            raw[:, dmin_at:dmin_at + 2] = dmin.view(np.uint8).reshape(nsb, 2)
        return raw.reshape(rows, cols // block * size)
    w = rng.normal(0, std, size=(rows, cols)).astype(np.float32)
    if qtype == T.F32:
        return w
    try:
        return gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        raise ValueError(f"no writer for GGUF type {qtype!r}") from None


def finish_gguf(w, tensors: dict[str, tuple[np.ndarray, object]]) -> None:
    """Add `tensors` ({GGUF name: (array, ggml type)}: F32 ones as float32 arrays, any other type as its raw bytes
    uint8 [..., row bytes]) to the gguf.GGUFWriter `w` and write its file."""
    for name, (a, qtype) in tensors.items():
        if qtype == T.F32:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        else:
            w.add_tensor(name, np.ascontiguousarray(a), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenizer_fields(tokenizer_gguf: str) -> list[tuple]:
    """(key, value, type, sub_type) of every tokenizer.* field of a GGUF file (parsed by the engine's faster reader)."""
    from engine.loading.gguf_file import open_gguf

    reader = open_gguf(tokenizer_gguf)
    return [(name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
            for name, f in reader.fields.items() if name.startswith("tokenizer.")]


def write_tiny_llama(path: Path, mix: dict[str, object], tokenizer: list[tuple], seed: int = 0,
                     std: float = 0.08) -> dict[str, tuple[np.ndarray, object]]:
    """A tiny Llama GGUF at `path` (shape above; norms F32 around 1) whose tensors of each role have the mix's type,
    tokenizer fields `tokenizer` (from `tokenizer_fields`). Returns {GGUF name: (stored array, type)}: raw bytes as
    written, for `write_dequantized` and for comparisons with gguf-py's dequantize."""
    rng = np.random.default_rng(seed)
    vocab = len(next(v for k, v, *_ in tokenizer if k == "tokenizer.ggml.tokens"))
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd": (vocab, HIDDEN), "output": (vocab, HIDDEN), "attn_q": (HIDDEN, HIDDEN),
              "attn_k": (KV_HEADS * head_dim, HIDDEN), "attn_v": (KV_HEADS * head_dim, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
              "ffn_down": (HIDDEN, INTERMEDIATE)}
    tensors: dict[str, tuple[np.ndarray, object]] = {}
    for role in ("token_embd", "output"):
        tensors[f"{role}.weight"] = (random_tensor(mix[role], *shapes[role], 1.0 if role == "token_embd" else std,
                                                   rng), mix[role])
    tensors["output_norm.weight"] = ((1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32), T.F32)
    for i in range(LAYERS):
        for role in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            qtype = mix[role][i] if isinstance(mix[role], tuple) else mix[role]
            tensors[f"blk.{i}.{role}.weight"] = (random_tensor(qtype, *shapes[role], std, rng), qtype)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = ((1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32), T.F32)
    _write(path, tensors, tokenizer, vocab)
    return tensors


def write_dequantized(path: Path, tensors: dict[str, tuple[np.ndarray, object]], tokenizer: list[tuple]) -> None:
    """The same model with every tensor as gguf-py's float32 dequantization of `tensors` (F32 GGUF): the reference
    a quantized file must equal."""
    plain = {name: (np.asarray(gguf.quants.dequantize(a, qtype), dtype=np.float32), T.F32)
             for name, (a, qtype) in tensors.items()}
    vocab = plain["token_embd.weight"][0].shape[0]
    _write(path, plain, tokenizer, vocab)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, object]], tokenizer: list[tuple], vocab: int) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(vocab)
    for name, value, vtype, sub in tokenizer:
        w.add_key_value(name, value, vtype, sub_type=sub)
    finish_gguf(w, tensors)


@contextmanager
def parsing_each_gguf_once(keep: int | None = None, pinned: Collection[str] = ()) -> Iterator[dict]:
    """engine.loading.gguf_file.open_gguf patched, for the `with` block, to return the first parse of a file again while
    it is unchanged (its path, size, modification and change times, inode). Every test GGUF carries SmolLM2's 49k-token
    vocabulary, whose metadata parse is about 0.2 CPU-s, and the loaders only read a parse, so what they load is
    unchanged. `keep`: the parses of at most that many files are kept, the least recently opened dropped first (each
    holds tens of MB: its small arrays and its file's mapping), except those of the files `pinned` (paths). A path that
    cannot be stat'ed is opened as open_gguf opens it (its error). Yields the parses, by key."""
    from engine.loading import gguf_file

    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 parse, got {keep}")
    parse, parsed = gguf_file.open_gguf, OrderedDict()
    always = {os.path.realpath(p) for p in pinned}

    def open_once(path: str):
        try:
            st = os.stat(path)
        except OSError:
            return parse(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        got = parsed[key] = parsed.pop(key) if key in parsed else parse(path)  # the most recent last
        if keep is not None:
            evictable = [k for k in parsed if k[0] not in always]
            for old in evictable[:max(0, len(evictable) - keep)]:
                del parsed[old]
        return got

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_file, "open_gguf", open_once)
        yield parsed
