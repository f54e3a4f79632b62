"""GPTQ and AWQ (GEMM) linear layers of a Hugging Face folder, unpacked to IntGroupWeight (engine.loading.quant_groups).

Layouts (int32 words, element i of a word in bits [i * bits, (i + 1) * bits), 32 / bits elements a word):
    GPTQ (AutoGPTQ / GPTQModel, `quant_method: gptq`; Frantar et al., 2022):
        qweight int32 [K / (32/bits), N]   packed along the input features: W[n, k] is element k % (32/bits) of
                                           word [k // (32/bits), n]
        qzeros  int32 [G, N / (32/bits)]   packed along the outputs
        scales  fp16  [G, N]
        g_idx   int32 [K]                  the group of each input feature (act-order: not k // group_size)
      W[n, k] = (q - z) * s. The v1 checkpoint format (the default) stores z - 1 (read: stored + 1, so 1 .. 2^bits;
      AutoGPTQ's dequantize), `checkpoint_format: gptq_v2` (GPTQModel) stores z itself.
    AWQ GEMM (AutoAWQ WQLinear_GEMM, `quant_method: awq`, `version: gemm`; Lin et al., 2023), 4 bits:
        qweight int32 [K, N / 8], qzeros int32 [G, N / 8]   both packed along the outputs in AWQ's interleaved
                                           order: element i of a word is output column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]
        scales  fp16  [G, N]
      W[n, k] = (q - z) * s, groups contiguous (no g_idx).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.loading.quant_groups import IntGroupWeight, plain_group_index

#: AutoAWQ's packing order: element i of a word holds output column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

GetTensor = Callable[[str], "torch.Tensor | None"]


def unpack_int32(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int16 [R, C, 32 / bits]: element i of each word (bits [i * bits, (i + 1) * bits))."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {words.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.int16)


def _need(get: GetTensor, key: str) -> torch.Tensor:
    t = get(key)
    if t is None:
        raise ValueError(f"checkpoint lacks {key}, which its quantization_config says it holds")
    return t


def read_gptq(get: GetTensor, prefix: str, bits: int, group_size: int, v1: bool) -> IntGroupWeight:
    """The GPTQ layer `prefix` (e.g. "model.layers.0.mlp.down_proj") through `get` (checkpoint key -> tensor or None).

    Raises ValueError for a missing tensor or shapes that do not agree with `bits`."""
    per_word = 32 // bits
    qweight = _need(get, f"{prefix}.qweight")
    words_k, n = qweight.shape
    k = words_k * per_word
    q = unpack_int32(qweight, bits).permute(0, 2, 1).reshape(k, n).t().contiguous()  # [N, K]
    scales = _need(get, f"{prefix}.scales").t().contiguous()  # [N, G]
    qzeros = get(f"{prefix}.qzeros")
    if qzeros is None:  # symmetric checkpoints may leave it out: z = 2^(bits - 1)
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int16)
    else:
        zeros = unpack_int32(qzeros, bits).reshape(qzeros.shape[0], -1).t().contiguous()[:n]
        if v1:
            zeros = zeros + 1
    g_idx = get(f"{prefix}.g_idx")
    g_idx = plain_group_index(k, group_size) if g_idx is None else g_idx.to(torch.int64)
    if zeros.shape != scales.shape or g_idx.shape != (k,) or int(g_idx.max()) >= scales.shape[1]:
        raise ValueError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros {tuple(zeros.shape)} (unpacked, "
                         f"[N, G]), scales {tuple(scales.shape)} and g_idx {tuple(g_idx.shape)} do not agree for "
                         f"{bits}-bit GPTQ")
    return IntGroupWeight(q, zeros, scales, g_idx, bits)


def read_awq_gemm(get: GetTensor, prefix: str, bits: int, group_size: int) -> IntGroupWeight:
    """The AWQ GEMM layer `prefix` through `get`. Raises ValueError for a missing tensor or disagreeing shapes."""
    if bits != 4:
        raise ValueError(f"AWQ GEMM checkpoints hold 4-bit weights; quantization_config.bits is {bits}")
    reverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])

    def columns(words: torch.Tensor) -> torch.Tensor:  # int32 [R, N / 8] -> int16 [R, N] in column order
        return unpack_int32(words, 4)[..., reverse].reshape(words.shape[0], -1)

    qweight = _need(get, f"{prefix}.qweight")
    q = columns(qweight).t().contiguous()  # [N, K]
    n, k = q.shape
    scales = _need(get, f"{prefix}.scales").t().contiguous()
    qzeros = get(f"{prefix}.qzeros")
    zeros = (torch.full(scales.shape, 8, dtype=torch.int16) if qzeros is None
             else columns(qzeros).t().contiguous())
    if zeros.shape != scales.shape or scales.shape[0] != n:
        raise ValueError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros and scales {tuple(scales.shape)} do not "
                         "agree for 4-bit AWQ GEMM")
    return IntGroupWeight(q, zeros, scales, plain_group_index(k, group_size), bits)
