"""GGUF Q4_0 / Q4_1 tensors straight into the portable INT4 format, with no requantizing.

ggml block layouts (ggml docs and ggml-quants.c; 32 weights per block, blocks run along a row):
    Q4_0: fp16 d, 16 bytes qs               w = d * (q - 8)      -> scale = d, zero = 0
    Q4_1: fp16 d, fp16 m, 16 bytes qs       w = d * q + m        -> scale = d, zero = m + 8d
Byte j of qs holds element j in its low nibble and element j + 16 in its high nibble. In the tinygemm convention
w = (q - 8) * scale + zero both map exactly, group size 32. Scales and zeros are kept in fp32 (exact for fp16 d and
m), so on the fp32 path the INT4 model computes the same weights as `gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.gguf_blocks import GGUFBlocks
from engine.quant.qparams import Int4Weight

GGUF_GROUP_SIZE = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def is_native_int4(tensor_type_name: str) -> bool:
    """True for the GGUF types that load as INT4 without requantizing (Q4_0, Q4_1)."""
    return tensor_type_name in _BLOCK_BYTES


def gguf_q4_to_int4(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Weight:
    """Int4Weight (group 32, fp32 scales/zeros) from the raw bytes of a Q4_0/Q4_1 tensor.

    raw: the GGUFReader tensor's `data` (uint8, any shape holding N * K / 32 blocks); shape: (N, K) in torch order.
    Raises ValueError for other types or when K is not a multiple of 32.
    """
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"{type_name} is not a 4-bit GGUF type this loader maps natively (Q4_0, Q4_1); "
                         "load it dequantized with quantization='none' or requantize it")
    n, k = shape
    blocks = GGUFBlocks.from_raw(raw, type_name, shape)  # raises for K not a multiple of 32
    qs = blocks.qs.numpy()
    d = blocks.scales
    zeros = blocks.mins + 8 * d  # type: ignore[operator]  # Q4_1: m + 8d; Q4_0: -8d + 8d = 0 (exact)
    # Repack each block's 16 bytes straight into the portable order (element 2j high, 2j + 1 low): elements 0..15
    # are the low nibbles of qs, so packed byte i < 8 = lo(qs[2i]) << 4 | lo(qs[2i+1]); bytes 8..15 take the high
    # nibbles of the same pairs. Vectorized numpy on uint8 (byte-wise torch ops on strided views were 10x slower).
    even, odd = qs[..., 0::2], qs[..., 1::2]
    packed = np.concatenate(((even << 4) | (odd & 15), (even & 0xF0) | (odd >> 4)), axis=-1).reshape(n, k // 2)
    return Int4Weight(torch.from_numpy(packed), d, zeros, k, GGUF_GROUP_SIZE)
