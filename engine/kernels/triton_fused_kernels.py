"""Triton kernels for the decoder's elementwise work on the GPU: RMSNorm (with the residual add), SwiGLU's
silu_and_mul, and RoPE of Q and K with the K/V store into the paged cache.

Imported only by engine/kernels/triton_fused.py, lazily, because importing this module imports triton. The launch
wrappers
and input checks live there; this module holds the `@triton.jit` bodies only.

Numerics follow the torch path they replace on CUDA (engine/layers/rms_norm.py, engine/layers/rope.py,
engine/model/decoder.py), op by
op: every intermediate the torch path rounds to the activation dtype is rounded here too (a no-op in fp32), so bf16
and fp16 outputs equal torch's up to the fp32 arithmetic's last bit (rsqrt, exp and FMA contraction). Sources:
Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019), as HF transformers' LlamaRMSNorm computes it;
Su et al., "RoFormer" (2021), in HF's rotate-half form; Shazeer, "GLU Variants Improve Transformer" (2020). The
fusions are vLLM's fused_add_rms_norm, silu_and_mul and rotary_embedding + reshape_and_cache.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, sum_ptr, weight_ptr, out_ptr, stride_xr, stride_xc, hidden, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program. out = round(weight * round(x * rsqrt(mean(x^2) + eps))), x in fp32 (HF's
    LlamaRMSNorm). With HAS_RESIDUAL: x = round(residual + x) first, stored to sum_ptr (the decoder's skip
    connection), and that sum is normalized. residual, sum and out are contiguous [T, hidden]; BLOCK >= hidden."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_xr + offs * stride_xc, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * hidden + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * hidden + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (w * normed).to(x.dtype), mask=mask)


@triton.jit
def silu_and_mul_kernel(gate_up_ptr, out_ptr, inter, stride_r, stride_c, BLOCK: tl.constexpr):
    """out[t, i] = round(round(silu(gate)) * up) with gate = gate_up[t, i], up = gate_up[t, inter + i]: torch's
    F.silu(gate) * up, each op rounded to the dtype. Program (t, j) owns columns j * BLOCK ... of row t; out is
    contiguous [T, inter]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    base = gate_up_ptr + row * stride_r
    g = tl.load(base + offs * stride_c, mask=mask, other=0.0)
    u = tl.load(base + (offs + inter) * stride_c, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + offs, (silu * u.to(tl.float32)).to(g.dtype), mask=mask)


@triton.jit
def rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr, stride_qkv,
                         num_heads, num_kv_heads, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                         HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (t, j) owns heads j * BLOCK_H ... of token t's fused QKV row [(H + 2 Hkv) * HEAD_DIM]: Q heads are
    rotated into q [T, H, HEAD_DIM], K heads rotated and V heads copied into the caches [slots, Hkv, HEAD_DIM] at
    slot_mapping[t] (skipped when that is negative). RoPE as the torch path: x * cos + rotate_half(x) * sin, each
    product and the sum rounded to the dtype, over the first ROT_DIM dims of a head (HALF_PAD >= ROT_DIM / 2 lanes);
    with ROT_DIM < HEAD_DIM (partial rotary) the other dims are copied (PASS_PAD >= HEAD_DIM - ROT_DIM lanes).
    cos/sin are contiguous [T, ROT_DIM]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    half = ROT_DIM // 2
    d = tl.arange(0, HALF_PAD)
    d_mask = d < half
    qk_heads = num_heads + num_kv_heads
    m = (h < qk_heads + num_kv_heads)[:, None] & d_mask[None, :]
    row = qkv_ptr + t * stride_qkv + h[:, None].to(tl.int64) * HEAD_DIM + d[None, :]
    x1 = tl.load(row, mask=m, other=0.0)
    x2 = tl.load(row + half, mask=m, other=0.0)
    dtype = x1.dtype
    cs = cos_ptr + t * ROT_DIM + d
    sn = sin_ptr + t * ROT_DIM + d
    c1 = tl.load(cs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cs + half, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sn, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sn + half, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    y1 = ((f1 * c1).to(dtype).to(tl.float32) - (f2 * s1).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
    is_q = (h < num_heads)[:, None]
    is_k = ((h >= num_heads) & (h < qk_heads))[:, None]
    is_v = (h >= qk_heads)[:, None]
    y1 = tl.where(is_v, x1, y1)
    y2 = tl.where(is_v, x2, y2)
    q_dst = q_ptr + (t * num_heads + h[:, None]) * HEAD_DIM + d[None, :]
    tl.store(q_dst, y1, mask=m & is_q)
    tl.store(q_dst + half, y2, mask=m & is_q)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    kv_head = tl.where(is_v, h[:, None] - qk_heads, h[:, None] - num_heads).to(tl.int64)
    kv_dst = (slot * num_kv_heads + kv_head) * HEAD_DIM + d[None, :]
    cached = m & ((h.to(tl.int64) * 0 + slot) >= 0)[:, None]  # a tensor: the interpreter takes no scalar mask
    tl.store(k_cache_ptr + kv_dst, y1, mask=cached & is_k)
    tl.store(k_cache_ptr + kv_dst + half, y2, mask=cached & is_k)
    tl.store(v_cache_ptr + kv_dst, y1, mask=cached & is_v)
    tl.store(v_cache_ptr + kv_dst + half, y2, mask=cached & is_v)
    if ROT_DIM < HEAD_DIM:  # partial rotary: the dims past ROT_DIM of every head are copied
        e = ROT_DIM + tl.arange(0, PASS_PAD)
        pm = (h < qk_heads + num_kv_heads)[:, None] & (e < HEAD_DIM)[None, :]
        xp = tl.load(qkv_ptr + t * stride_qkv + h[:, None].to(tl.int64) * HEAD_DIM + e[None, :], mask=pm, other=0.0)
        tl.store(q_ptr + (t * num_heads + h[:, None]) * HEAD_DIM + e[None, :], xp, mask=pm & is_q)
        kv_pass = (slot * num_kv_heads + kv_head) * HEAD_DIM + e[None, :]
        cached_pass = pm & ((h.to(tl.int64) * 0 + slot) >= 0)[:, None]
        tl.store(k_cache_ptr + kv_pass, xp, mask=cached_pass & is_k)
        tl.store(v_cache_ptr + kv_pass, xp, mask=cached_pass & is_v)
