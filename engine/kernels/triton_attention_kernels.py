"""Triton kernels for paged attention: decode (with optional split-K) and varlen chunked prefill.

Imported only by engine/layers/triton_attention.py, lazily, because importing this module imports triton. The launch
wrappers, input checks and the engine entry point live there; this module holds the `@triton.jit` bodies only.

Every kernel reads K/V through the block table (Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023) and runs the online softmax of FlashAttention-2 (Dao, "FlashAttention-2:
Faster Attention with Better Parallelism and Work Partitioning", 2023) in fp32, in base 2 (`exp2`, with log2(e)
folded into the scale). Grouped-query attention (Ainslie et al., "GQA", 2023) is packed into the rows of one tile:
a program owns one KV head and all of its query heads, so each K/V tile is loaded once for the whole group.

Sliding window (Mistral; Jiang et al., "Mistral 7B", 2023): with USE_WINDOW the query at position i sees keys
i - window < j <= i only (HF transformers' `sliding_window_overlay`); the key loops start at the tile holding the
earliest key a program's queries can see, so whole tiles before the window are never read.

Soft-capping (Gemma 2; Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024): with SOFTCAP
each scaled score s becomes c * tanh(s / c) before the mask and the softmax. The kernels hold scores in base-2 units
(s * log2(e)), and c * tanh(s / c) * log2(e) = c' * tanh(s * log2(e) / c') with c' = c * log2(e), so they take
`softcap_log2e` = c' and cap the base-2 score directly (`_softcap`).

Cache layout (see engine/layers/attention.py): k_cache, v_cache [num_blocks, PAGE_SIZE, num_kv_heads, head_dim]; key t
of
request b sits in page block_tables[b, t // PAGE_SIZE] at offset t % PAGE_SIZE.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_kv_tile(cache_ptr, block_tables_ptr, b, kvh, n, n_mask, offs_d, d_mask,
                  stride_bt, stride_cb, stride_cs, stride_ch, stride_cd, PAGE_SIZE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] keys (or values) at logical positions n of request b, KV head kvh; 0 where masked."""
    page = tl.load(block_tables_ptr + b * stride_bt + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    # NOTE: int64 offsets: num_blocks * block stride overflows int32 for caches over 2^31 elements.
    row = page * stride_cb + (n % PAGE_SIZE).to(tl.int64) * stride_cs + kvh.to(tl.int64) * stride_ch
    return tl.load(cache_ptr + row[:, None] + offs_d[None, :] * stride_cd,
                   mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, BF16_WORKAROUND: tl.constexpr):
    """tl.dot with fp32 accumulation. BF16_WORKAROUND (interpreter only): Triton 3.9's interpreter multiplies bf16
    operands as their raw uint16 bit patterns, so upcast them to fp32 first (exact: bf16 products fit in fp32)."""
    if BF16_WORKAROUND:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_PRECISION)
    return c


@triton.jit
def _softcap(s, softcap_log2e):
    """c' * tanh(s / c') elementwise (fp32), tanh from exp2: tanh(|x|) = (1 - e) / (1 + e) with e = 2^(-2 log2(e)
    |x|) in (0, 1], so nothing overflows for any finite or infinite s, and the sign put back."""
    x = s / softcap_log2e
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return softcap_log2e * tl.where(x < 0.0, -t, t)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, visible, b, kvh, n, n_mask, offs_d, d_mask, scale_log2e, softcap_log2e,
                 k_cache_ptr, v_cache_ptr, block_tables_ptr, stride_bt,
                 stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
                 PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, BF16_WORKAROUND: tl.constexpr,
                 EMPTY_ROWS: tl.constexpr, SOFTCAP: tl.constexpr):
    """One step of the online softmax (FlashAttention-2, base 2) over the key tile at positions n: returns the
    updated (m_i, l_i, acc) of the q rows. visible: [rows, BLOCK_N] (or broadcastable) keys each row may see.
    EMPTY_ROWS: a row may see no key of the tile while its max is still -inf (a sliding window); its max is then
    taken as 0 so alpha and p are 0, not NaN. SOFTCAP: scores are capped to softcap_log2e * tanh(s / softcap_log2e)
    (base-2 units) after the scale, before the mask."""
    k = _load_kv_tile(k_cache_ptr, block_tables_ptr, b, kvh, n, n_mask, offs_d, d_mask,
                      stride_bt, stride_kb, stride_ks, stride_kh, stride_kd, PAGE_SIZE)
    s = _dot(q, tl.trans(k.to(q.dtype)), DOT_PRECISION, BF16_WORKAROUND) * scale_log2e
    if SOFTCAP:
        s = _softcap(s, softcap_log2e)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY_ROWS:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_tile(v_cache_ptr, block_tables_ptr, b, kvh, n, n_mask, offs_d, d_mask,
                      stride_bt, stride_vb, stride_vs, stride_vh, stride_vd, PAGE_SIZE)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, BF16_WORKAROUND)
    return m_new, l_i, acc


@triton.jit
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2e, softcap_log2e, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    num_heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, BF16_WORKAROUND: tl.constexpr, USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One query token per request. Grid (B, num_kv_heads, NUM_SPLITS).

    Program (b, kvh, s) takes the GROUP query heads of KV head kvh (rows padded to BLOCK_H >= 16 for tl.dot) over
    its share of the context: the request's ceil(seq_len / BLOCK_N) key tiles are cut into NUM_SPLITS contiguous
    runs (split-K, "flash decoding"), sized from the device seq_len so the grid depends on shapes only (CUDA-graph
    safe). With NUM_SPLITS == 1 it writes the normalized output; otherwise it writes the unnormalized fp32
    accumulator and the running max / sum (base 2) of its run, combined by `paged_decode_reduce_kernel`. With
    USE_WINDOW only the tiles from the one holding key seq_len - window on are split and read.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    key_lo = 0
    first_tile = 0
    if USE_WINDOW:
        key_lo = tl.maximum(seq_len - window, 0)
        first_tile = key_lo // BLOCK_N
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    # NOTE: every tile we visit holds at least one visible key (first_tile <= tile < num_tiles, and the window's
    # keys are contiguous up to seq_len - 1), so m_i is finite after the first tile and exp2(m_i - m_new) never
    # sees -inf - -inf. Padded head rows score 0 against real keys: finite too.
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        n = tile * BLOCK_N + offs_n
        n_mask = (n < seq_len) & (n >= key_lo)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, n_mask[None, :], b, kvh, n, n_mask, offs_d, d_mask,
                                     scale_log2e, softcap_log2e, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                                     stride_bt,
                                     stride_kb, stride_ks, stride_kh, stride_kd,
                                     stride_vb, stride_vs, stride_vh, stride_vd,
                                     PAGE_SIZE, DOT_PRECISION, BF16_WORKAROUND, False, SOFTCAP)

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        # Partials are contiguous: acc [B, H, NUM_SPLITS, HEAD_DIM], m and l [B, H, NUM_SPLITS], fp32.
        row = (b.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=h_mask[:, None] & d_mask[None, :])
        tl.store(part_m_ptr + row, m_i, mask=h_mask)
        tl.store(part_l_ptr + row, l_i, mask=h_mask)


@triton.jit
def paged_decode_reduce_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr,
    stride_ot, stride_oh, stride_od,
    num_heads,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine the split-K partials of one (request, query head). Grid (B, num_heads).

    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s; an empty split has m_s = -inf and
    weighs 0. Split 0 always holds a key (seq_len >= 1), so M is finite.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    row = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                  other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= tile (binary search; the left edge is monotonic in b)."""
    lo = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale_log2e, softcap_log2e, num_requests, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BF16_WORKAROUND: tl.constexpr, USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Varlen causal attention, queries at the end of each context. Grid (T // BLOCK_Q + B, num_kv_heads).

    Request b's q_len queries are cut into tiles of BLOCK_Q tokens; its tiles take program ids from
    query_start_loc[b] // BLOCK_Q + b on (a bound that needs no host data, so the grid depends on T and B only;
    programs past a request's last tile exit at once). A tile's BLOCK_M = BLOCK_Q * GROUP (padded) rows are
    (token, query head) pairs of one KV head. Query j of the request sits at position seq_len - q_len + j and sees
    keys 0..that position (with USE_WINDOW: keys position - window + 1..position), all read from the paged cache
    (this step's K/V already written there).
    """
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = _find_request(query_start_loc_ptr, tile, num_requests, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    local_tile = tile - (q_start // BLOCK_Q + b)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = local_tile * BLOCK_Q + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = ctx_len + tok

    # Keys up to the tile's last query position. NOTE: without a window key 0 is visible to every row, so after the
    # first key tile every row's running max is finite (no -inf - -inf in exp2). With one, a row may see no key of
    # a tile (its window starts later), so its max is taken as 0 while it is -inf: alpha and p are then 0, not NaN.
    kv_end = ctx_len + tl.minimum(q_len, (local_tile + 1) * BLOCK_Q)
    kv_lo = 0
    kv_start = 0
    if USE_WINDOW:  # from the tile holding the first key the tile's first query sees; keys before it are not loaded
        kv_lo = tl.maximum(ctx_len + local_tile * BLOCK_Q - window + 1, 0)
        kv_start = kv_lo // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + offs_n
        n_mask = (n < kv_end) & (n >= kv_lo)
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if USE_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, visible, b, kvh, n, n_mask, offs_d, d_mask,
                                     scale_log2e, softcap_log2e, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                                     stride_bt,
                                     stride_kb, stride_ks, stride_kh, stride_kd,
                                     stride_vb, stride_vs, stride_vh, stride_vd,
                                     PAGE_SIZE, DOT_PRECISION, BF16_WORKAROUND, USE_WINDOW, SOFTCAP)

    if USE_WINDOW:  # padded rows (not stored) may have seen no key at all
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
