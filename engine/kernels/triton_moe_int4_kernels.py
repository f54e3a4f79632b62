"""The Triton kernel of the INT4 (W4A16) mixture-of-experts block on the GPU: one grouped GEMM over every expert's
rows at once, the experts' weights read as packed nibbles and dequantized in registers.

Imported only by engine/kernels/triton_moe_int4.py, lazily, because importing this module imports triton. The form
is engine/kernels/triton_moe_kernels.py's (the sorted, padded (token, slot) pairs: see there); the weight tile is
built from the portable INT4 format of engine.quant.qparams instead of loaded: byte j of a weight row holds element
2j in its high nibble and 2j + 1 in its low one, and w = (q - 8) * scale + zero with one (scale, zero) per group of
GROUP_SIZE input features. Loading each byte for both of its elements and shifting by 4 for the even ones is
vLLM's fused_moe_kernel_gptq_awq form (model_executor/layers/fused_moe); the dequantized tile is rounded to the
activations' dtype and multiplied on the tensor cores with fp32 accumulation, as the dense kernel does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.triton_moe_kernels import block_of_pairs, store_rows


@triton.jit
def grouped_gemm_int4_kernel(a_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, c_ptr, weights_ptr,
                             sorted_pairs_ptr, block_expert_ptr, padded_total_ptr, N, K, num_pairs,
                             stride_am, stride_ak, stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sg,
                             stride_pe, stride_cm, stride_cn, GROUP_SIZE: tl.constexpr, A_ROW_DIV: tl.constexpr,
                             MUL_WEIGHT: tl.constexpr, HAS_PERM: tl.constexpr, IEEE: tl.constexpr,
                             BF16_WORKAROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """c[p, n] = sum_k a[p // A_ROW_DIV, col(e, k)] * w[e, n, k] for every pair p of one BLOCK_M block of the sorted
    pairs (all of expert e = block_expert[block]), times weights[p] when MUL_WEIGHT; col(e, k) = perm[e, k] with
    HAS_PERM (act-order), else k.

    a: [rows, K] activations (x with A_ROW_DIV = top_k, or the [T * top_k, K] intermediate with 1). qweight: uint8
    [E, N, Kp / 2]; scales, zeros: [E, N, Kp / GROUP_SIZE] (any float dtype); w = (q - 8) * scale + zero in fp32,
    then rounded to a's dtype. perm: int64 [E, K] (unused without HAS_PERM). K is the unpadded width: the columns
    past it meet zero activations. BLOCK_K divides GROUP_SIZE, so a K tile lies in one group and never passes Kp.
    c, weights, sorted_pairs, block_expert, padded_total, IEEE, BF16_WORKAROUND and the program order as
    triton_moe_kernels.grouped_gemm_kernel."""
    past_total, pairs, row_ok, a_rows, expert, offs_n, col_ok = block_of_pairs(
        sorted_pairs_ptr, block_expert_ptr, padded_total_ptr, N, num_pairs, A_ROW_DIV, BLOCK_M, BLOCK_N)
    if past_total:
        return
    offs_k = tl.arange(0, BLOCK_K)
    shifts = ((1 - offs_k % 2) * 4)[:, None]  # element 2j: the high nibble of byte j
    q_block = qweight_ptr + expert * stride_qe + offs_n[None, :] * stride_qn + (offs_k // 2)[:, None] * stride_qk
    scale_row = scales_ptr + expert * stride_se + offs_n * stride_sn
    zero_row = zeros_ptr + expert * stride_se + offs_n * stride_sn
    a_row = a_ptr + a_rows[:, None] * stride_am
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        cols = k0 + offs_k
        if HAS_PERM:  # act-order: column k of the weight meets activation column perm[e, k]
            cols = tl.load(perm_ptr + expert * stride_pe + cols, mask=k_ok, other=0)
        a = tl.load(a_row + cols[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        q = (tl.load(q_block, mask=col_ok[None, :], other=0) >> shifts) & 0xF
        group = k0 // GROUP_SIZE
        scale = tl.load(scale_row + group * stride_sg, mask=col_ok, other=0.0).to(tl.float32)
        zero = tl.load(zero_row + group * stride_sg, mask=col_ok, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]
        if BF16_WORKAROUND:  # interpreter only: it multiplies bf16 as raw uint16 bits; exact in fp32
            acc = tl.dot(a.to(tl.float32), w.to(tl.bfloat16).to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
        q_block += (BLOCK_K // 2) * stride_qk
    store_rows(acc, c_ptr, weights_ptr, pairs, row_ok, offs_n, col_ok, stride_cm, stride_cn, MUL_WEIGHT)
