"""The Triton kernel of the mixture-of-experts block on the GPU: one grouped GEMM over every expert's rows at once.

Imported only by engine/kernels/triton_moe.py, lazily, because importing this module imports triton. The row
alignment, launch wrappers and input checks live there; this module holds the `@triton.jit` bodies only (its
block_of_pairs and store_rows serve engine/kernels/triton_moe_int4_kernels.py too).

The form is the standard fused-MoE one (vLLM's fused_moe, SGLang's; Gale et al., "MegaBlocks: Efficient Sparse
Training with Mixture-of-Experts", 2022, for grouping the rows by expert): the step's (token, slot) pairs are sorted
by expert and each expert's run of pairs is padded to a multiple of BLOCK_M, so every BLOCK_M block of the sorted
list belongs to one expert. A program multiplies one such block of rows by one BLOCK_N slice of its expert's weight;
the pairs and block experts live in device tensors and blocks past the padded total return at once, so nothing is
read on the host and the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, padded_total_ptr,
                        N, K, num_pairs, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                        A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                        BF16_WORKAROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """c[p, n] = sum_k a[p // A_ROW_DIV, k] * b[e(p), n, k] for every pair p of one BLOCK_M block of the sorted
    pairs (all of expert e(p) = block_expert[block]), times weights[p] when MUL_WEIGHT.

    a: [rows, K] activations (x [T, K] with A_ROW_DIV = top_k, or the [T * top_k, K] intermediate with 1); b: the
    stacked weights [E, N, K] (nn.Linear layout); c: [T * top_k, N], written at the pair's row (padding is never
    stored); weights: [T * top_k] routing weights of c's dtype. sorted_pairs: [capacity] int64 pair ids, grouped by
    expert, padding = num_pairs; block_expert: [capacity / BLOCK_M] int64; padded_total_ptr: the int64 count of
    used entries. BF16_WORKAROUND (Triton 3.9's interpreter only) upcasts bf16 operands before tl.dot. Program (m, n) in
    row-major order. Accumulates in fp32 (IEEE: full fp32 products, not TF32), rounds
    to c's dtype, then multiplies by the weight and rounds again (the torch path's out.mul_(weights))."""
    past_total, pairs, row_ok, a_rows, expert, offs_n, col_ok = block_of_pairs(
        sorted_pairs_ptr, block_expert_ptr, padded_total_ptr, N, num_pairs, A_ROW_DIV, BLOCK_M, BLOCK_N)
    if past_total:
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_block = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_block = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_block, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_block, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if BF16_WORKAROUND:  # interpreter only: it multiplies bf16 as raw uint16 bits; exact in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_block += BLOCK_K * stride_ak
        b_block += BLOCK_K * stride_bk
    store_rows(acc, c_ptr, weights_ptr, pairs, row_ok, offs_n, col_ok, stride_cm, stride_cn, MUL_WEIGHT)


@triton.jit
def block_of_pairs(sorted_pairs_ptr, block_expert_ptr, padded_total_ptr, N, num_pairs, A_ROW_DIV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile, program (m, n) in row-major order: (past_total: its block m lies past the padded total
    and it has nothing to do, pairs [BLOCK_M] ids, row_ok [BLOCK_M] (False on padding), a_rows [BLOCK_M] int64 =
    pair // A_ROW_DIV (0 on padding), the block's expert int64, offs_n [BLOCK_N] output columns, col_ok [BLOCK_N]:
    offs_n < N)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = tl.where(row_ok, pairs // A_ROW_DIV, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return pid_m * BLOCK_M >= tl.load(padded_total_ptr), pairs, row_ok, a_rows, expert, offs_n, offs_n < N


@triton.jit
def store_rows(acc, c_ptr, weights_ptr, pairs, row_ok, offs_n, col_ok, stride_cm, stride_cn,
               MUL_WEIGHT: tl.constexpr):
    """Round the fp32 tile acc [BLOCK_M, BLOCK_N] to c's dtype, times weights[pair] (then rounded again) when
    MUL_WEIGHT, and store it at the pairs' rows of c (padding rows and columns past N are not stored)."""
    out = acc.to(c_ptr.dtype.element_ty)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
        out = (out.to(tl.float32) * w.to(tl.float32)[:, None]).to(c_ptr.dtype.element_ty)
    c_block = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_block, out, mask=row_ok[:, None] & col_ok[None, :])
