"""GGUF Q4_0 / Q4_1 / Q4_K tensors straight into the portable INT4 format, with no requantizing.

ggml block layouts (ggml docs and ggml-quants.c; 32 weights per block, blocks run along a row):
    Q4_0: fp16 d, 16 bytes qs               w = d * (q - 8)      -> scale = d, zero = 0
    Q4_1: fp16 d, fp16 m, 16 bytes qs       w = d * q + m        -> scale = d, zero = m + 8d
    Q4_K: 256-weight super-blocks of eight 32-weight groups, w = (d * sc) * q - dmin * m per group (6-bit sc, m)
                                                                 -> scale = d * sc, zero = 8 * scale - dmin * m
Byte j of qs holds element j in its low nibble and element j + 16 in its high nibble (Q4_K: engine.kernels.
gguf_blocks regroups its nibbles into that order). In the tinygemm convention w = (q - 8) * scale + zero all three
map onto the same integers, group size 32. Scales and zeros are kept in fp32. A scale is exact (fp16 d, or d * sc:
17 significant bits). A zero is exact whenever |zero| < 1: fp16 numbers and their integer multiples are multiples of
2^-24, so such a sum below 1 fits fp32's 24 bits; that holds in every group of a trained model, whose weights lie
far inside (-1, 1). Then (q - 8) * scale is exact too and the one rounding of the add is gguf-py's one rounding of
d * q + m (or d * q - dm): the fp32 path computes `gguf.quants.dequantize`'s weights exactly (bit for bit but for
the sign of a zero weight where d < 0, as engine.kernels.gguf_blocks says of Q4_0). A larger zero is rounded once
(by half an fp32 ulp of itself). The CUDA kernels round scales and zeros to bf16, as for every INT4
weight.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.gguf_blocks import GGUFBlocks
from engine.loading.gguf_native_int4 import GGUF_GROUP_SIZE, NATIVE_INT4_TYPES
from engine.quant.qparams import Int4Weight
from engine.quant.stacked_int4 import StackedInt4


def gguf_q4_to_int4(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Int4Weight | StackedInt4:
    """Int4Weight (group 32, fp32 scales/zeros) from the raw bytes of a Q4_0/Q4_1/Q4_K tensor.

    raw: the GGUFReader tensor's `data` (uint8, any shape holding the tensor's blocks); shape: (N, K) in torch order,
    or (E, N, K) for a mixture-of-experts layer's stacked experts (llama.cpp's ffn_{gate,up,down}_exps: each expert's
    rows run on from the previous one's, so its blocks are rows e * N ... (e + 1) * N - 1): then a StackedInt4
    [E, N, Kp/2] (views of one mapping of [E * N, K]). Raises ValueError for other types or when K is not a multiple
    of 32 (256 for Q4_K).
    """
    if len(shape) == 3:
        e, n, k = shape
        w = gguf_q4_to_int4(raw, type_name, (e * n, k))
        return StackedInt4(w.qweight.view(e, n, -1), w.scales.view(e, n, -1), w.zeros.view(e, n, -1), k,
                           GGUF_GROUP_SIZE)
    if type_name not in NATIVE_INT4_TYPES:
        raise ValueError(f"{type_name} is not a 4-bit GGUF type this loader maps natively "
                         f"({', '.join(NATIVE_INT4_TYPES)}); load it dequantized with quantization='none' or "
                         "requantize it")
    n, k = shape
    blocks = GGUFBlocks.from_raw(raw, type_name, shape)  # raises for K not a multiple of 32 (256)
    qs = blocks.qs.numpy()
    d = blocks.scales
    # Q4_1: m + 8d; Q4_0: -8d + 8d = 0 (exact); Q4_K: 8 d sc - dmin m
    zeros = blocks.mins + 8 * d  # type: ignore[operator]
    # Repack each block's 16 bytes straight into the portable order (element 2j high, 2j + 1 low): elements 0..15
    # are the low nibbles of qs, so packed byte i < 8 = lo(qs[2i]) << 4 | lo(qs[2i+1]); bytes 8..15 take the high
    # nibbles of the same pairs. Vectorized numpy on uint8 (byte-wise torch ops on strided views were 10x slower).
    even, odd = qs[..., 0::2], qs[..., 1::2]
    packed = np.concatenate(((even << 4) | (odd & 15), (even & 0xF0) | (odd >> 4)), axis=-1).reshape(n, k // 2)
    return Int4Weight(torch.from_numpy(packed), d, zeros, k, GGUF_GROUP_SIZE)
