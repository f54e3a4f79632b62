"""Paged attention on the GPU with Triton kernels: the same contract as `engine.layers.attention.paged_attention_ref`.

`paged_attention_triton` picks the decode kernel (one query per request, optional split-K over the context) when
`meta.decode_only`, else the varlen prefill kernel (chunked or full prefill, mixed with decodes). Triton is imported
lazily, on the first call, so the engine imports without it; on a machine without CUDA the kernels run in Triton's
interpreter when TRITON_INTERPRET=1 was set before triton was first imported (tests, CI), on CPU tensors.

Sources: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention" (SOSP 2023);
Dao, "FlashAttention-2" (2023); split-K decode as in Dao et al., "Flash-Decoding for long-context inference" (2023).
"""

from __future__ import annotations

import functools
import logging

import torch

from engine.layers.attention import AttentionMetadata, check_sliding_window, check_softcap, paged_attention_ref
from schemas import settings

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tile sizes. NOTE: tl.dot needs every dimension >= 16 on the GPU, so rows (query heads, tokens) pad to 16. Launched
# with 4 warps and 2 pipeline stages: the fp32 prefill tile then needs ~115 KB of shared memory at head_dim 128 (fits
# A100 and H100; bf16 ~33 KB). Untuned; its decode and prefill rates on an H100: bench/README.md "First run on
# hardware: H100 80GB HBM3, 2026-11-25".
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
MAX_SPLITS = 32
# A split-K run should span at least this many key tiles, or the reduction costs more than the parallelism buys.
MIN_TILES_PER_SPLIT = 4
_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    return settings.triton_interpret()


def triton_available() -> bool:
    """True when triton imports and either a CUDA device exists or TRITON_INTERPRET=1 (CPU interpreter).

    Only ImportError means "no triton": any other error of its import (a broken install) propagates. On a machine
    with CUDA, a missing triton is logged as a warning, once: attention then takes the torch reference (and the
    engine captures no CUDA graphs), many times slower, so it must not pass unseen.
    """
    try:
        import triton  # noqa: F401
    except ImportError as e:
        if torch.cuda.is_available():
            _warn_no_triton(f"{type(e).__name__}: {e}")
        return False
    return _interpreting() or torch.cuda.is_available()


@functools.cache
def _warn_no_triton(reason: str) -> None:
    log.warning("CUDA is here but triton does not import (%s): paged attention falls back to the torch reference "
                "and CUDA graphs are off, several times slower; pip install triton (the version your torch pins)",
                reason)


def _kernels():  # returns the lazily imported kernels module
    """Import the `@triton.jit` kernels on first use (importing them imports triton)."""
    from engine.kernels import triton_attention_kernels

    return triton_attention_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    """Raise ValueError on shapes, dtypes or devices the kernels do not handle."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"want q [T, H, D] and caches [blocks, block_size, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported; want one of {_DTYPES}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be an int32/int64 [B, max_blocks] tensor, got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} does not match block_tables {tuple(block_tables.shape)}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    device = q.device
    if device.type == "cuda" and _interpreting():
        raise ValueError("TRITON_INTERPRET=1 runs kernels on CPU tensors; got CUDA tensors")
    if device.type != "cuda" and not _interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU); got {device}")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 runs full-precision dots (not TF32) so the fp32 path matches the reference to ~1e-6.
    return "ieee" if dtype == torch.float32 else "tf32"


def _bf16_workaround(dtype: torch.dtype) -> bool:
    # Triton's interpreter (3.9) computes bf16 tl.dot on the raw bit patterns; the kernels upcast there instead.
    return dtype == torch.bfloat16 and _interpreting()


def decode_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, device: torch.device,
                      block_n: int = DECODE_BLOCK_N) -> int:
    """How many split-K runs the decode kernel cuts each context into; depends on shapes only (CUDA-graph safe).

    One program per (request, KV head) fills the GPU once there are about two per SM; below that, split the
    context (at most `MAX_SPLITS` runs of at least `MIN_TILES_PER_SPLIT` key tiles). 1 off CUDA (interpreter).
    """
    if device.type != "cuda":
        return 1
    programs = batch * num_kv_heads
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target:
        return 1
    max_tiles = -(-max_blocks * block_size // block_n)
    return max(1, min(-(-target // programs), max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, block_n: int = DECODE_BLOCK_N, *,
                           sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Paged decode attention: one query token per request.

    q: [B, H, D] (fp32/fp16/bf16; any strides); k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: int32 [B, max_blocks]; seq_lens: int32 [B] keys per request (>= 1, including this step's token,
    already written to the cache); scale: softmax scale (usually D**-0.5). Returns [B, H, D] in q's dtype.
    num_splits: split-K runs per context (None: `decode_num_splits`); block_n: keys per tile (power of 2, >= 16).
    sliding_window: W >= 1 reads only the last W keys of each context (the tiles holding them); None: all of them.
    softcap: c > 0 caps each scaled score s to c * tanh(s / c) before the softmax (Gemma 2); None: no cap.
    Raises ValueError on unsupported inputs. Sources: PagedAttention (Kwon et al., SOSP 2023), FlashAttention-2
    (Dao, 2023), Flash-Decoding (Dao et al., 2023).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of 2 >= 16, got {block_n}")
    batch, num_heads, head_dim = q.shape
    if batch != block_tables.shape[0]:
        raise ValueError(f"q has {batch} tokens but block_tables has {block_tables.shape[0]} requests")
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, block_tables.shape[1], block_size, q.device, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    kernels = _kernels()
    block_d = max(16, _next_pow2(head_dim))
    if num_splits > 1:
        part_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel when NUM_SPLITS == 1, but it wants pointers
        part_acc = part_m = part_l = out
    kernels.paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l,
        scale * _LOG2E, (softcap or 1.0) * _LOG2E, sliding_window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        num_heads,
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=block_size,
        BLOCK_H=max(16, _next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(q.dtype), BF16_WORKAROUND=_bf16_workaround(q.dtype),
        USE_WINDOW=sliding_window is not None, SOFTCAP=softcap is not None, num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        kernels.paged_decode_reduce_kernel[(batch, num_heads)](
            part_acc, part_m, part_l, out, *out.stride(), num_heads,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=_next_pow2(num_splits), BLOCK_D=block_d,
        )
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, block_m: int = PREFILL_BLOCK_M,
                            block_n: int = PREFILL_BLOCK_N, *, sliding_window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Paged varlen causal attention for prefill, chunked prefill and mixed prefill/decode steps.

    q: [T, H, D], the step's queries flattened; query_start_loc: int32 [B + 1] prefix sums of the per-request
    query lengths; seq_lens: int32 [B] keys per request after this step. Request b's queries sit at positions
    seq_lens[b] - q_len_b .. seq_lens[b] - 1 and attend causally to keys read through block_tables [B, max_blocks]
    from k_cache, v_cache [num_blocks, block_size, Hkv, D] (this step's K/V already written). Returns [T, H, D] in
    q's dtype. block_m: (token, head) rows per tile, block_n: keys per tile (powers of 2, >= 16). sliding_window:
    W >= 1 limits each query to its last W keys (whole key tiles before a query tile's windows are skipped); None:
    full causal. softcap: c > 0 caps each scaled score s to c * tanh(s / c) before the mask and softmax (Gemma 2);
    None: no cap. Raises ValueError on unsupported inputs. Sources: PagedAttention (Kwon et al., SOSP 2023),
    FlashAttention-2 (Dao, 2023).
    """
    _check_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of 2 >= 16, got {size}")
    batch = block_tables.shape[0]
    if query_start_loc.shape != (batch + 1,) or query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc must be [B + 1] = [{batch + 1}] on {q.device}, got "
                         f"{tuple(query_start_loc.shape)} on {query_start_loc.device}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or batch == 0:
        return out
    block_m = max(block_m, _next_pow2(group))
    block_q = block_m // group
    # One program per BLOCK_Q-token tile of each request: at most T // BLOCK_Q + B of them (see the kernel).
    grid = (num_tokens // block_q + batch, num_kv_heads)
    _kernels().paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E, (softcap or 1.0) * _LOG2E, batch, sliding_window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=max(16, _next_pow2(head_dim)), BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype), BF16_WORKAROUND=_bf16_workaround(q.dtype),
        USE_WINDOW=sliding_window is not None, SOFTCAP=softcap is not None, num_warps=4, num_stages=2,
    )
    return out


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, *, sliding_window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the step's queries over each request's paged keys and values (Triton path).

    Same contract as `engine.layers.attention.paged_attention_ref`: q [T, num_heads, head_dim]; k_cache, v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] already holding this step's K/V; returns [T, num_heads, head_dim]
    in q's dtype, softmax accumulated in fp32; `sliding_window` W >= 1 limits each query to its last W keys (None:
    full causal; an int, so a captured CUDA graph bakes it in); `softcap` c > 0 caps each scaled score s to
    c * tanh(s / c) before the mask and softmax (Gemma 2; None: no cap; a float, baked into a captured graph too).
    Decode-only steps take the split-K decode kernel, others the varlen prefill kernel; a step with image spans
    (meta.image_spans: bidirectional image attention, which the causal kernels do not implement) the torch path
    (engine.layers.attention.paged_attention_ref). Reads only device tensors of `meta` (no host sync; CUDA-graph
    safe for decode). Raises ValueError on unsupported inputs. Sources: PagedAttention (Kwon et al., SOSP 2023),
    FlashAttention-2 (Dao, 2023), Gemma 2 (Gemma Team, 2024).
    """
    if meta.image_spans:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, softcap=softcap)
    if meta.decode_only:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                      sliding_window=sliding_window, softcap=softcap)
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   scale, sliding_window=sliding_window, softcap=softcap)
