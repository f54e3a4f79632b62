"""Micro-benchmark: Triton paged attention kernels vs the torch reference, on a CUDA device.

Usage:
    python -m bench.attention_kernels                       # Llama-3.1-8B heads (32 q, 8 kv, head_dim 128), bf16
    python -m bench.attention_kernels --batch-sizes 1 8 64 256 --context-lens 512 2048 8192

Decode: every request has one query token and `context` keys (this step's included) in a paged cache of 16-token
blocks at shuffled block ids. Prints, per (batch, context): the split-K count chosen, the median time of the Triton
decode kernel and of `paged_attention_ref`, the speedup, the max abs difference, and the kernel's effective K/V read
bandwidth against a device copy measured in the same run (decode attention is bandwidth bound: it reads every cached
key and value once). Then one chunked-prefill step (`--prefill-batch` requests of `--prefill-chunk` new tokens on
`--prefill-context` keys) through both. Times are CUDA-event medians after warm-up, in milliseconds.
"""

from __future__ import annotations

import sys

import torch

from bench.common import cuda_ms, new_parser
from engine.layers.attention import AttentionMetadata, paged_attention_ref
from engine.layers.triton_attention import decode_num_splits, paged_attention_triton


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy of 1 GiB, in bytes/s (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / (ms / 1e3)


def make_step(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q [T, H, D], caches [num_blocks, block_size, Hkv, D] with each request's blocks at shuffled ids, and
    the step's metadata (slot_mapping left empty: the benchmark times attention only)."""
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    width = max(blocks)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = perm[start:start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=dtype, device=device)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables, query_lens=query_lens, seq_lens_host=seq_lens,
        decode_only=all(n == 1 for n in query_lens),
    )
    return q, k_cache, v_cache, meta


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--prefill-context", type=int, default=2048)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_bandwidth(device)
    h, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    scale = d ** -0.5
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.dtype}, heads {h}/{hkv}x{d}, "
          f"block {args.block_size}; copy bandwidth {bw / 1e9:,.0f} GB/s")
    print(f"\ndecode\n{'batch':>6} {'context':>8} {'splits':>6} {'triton ms':>10} {'ref ms':>9} {'speedup':>8} "
          f"{'max err':>8} {'GB/s':>7} {'% copy':>7}")
    for batch in args.batch_sizes:
        for ctx in args.context_lens:
            q, kc, vc, meta = make_step([1] * batch, [ctx] * batch, h, hkv, d, args.block_size, dtype, device)
            ours = paged_attention_triton(q, kc, vc, meta, scale)
            ref = paged_attention_ref(q, kc, vc, meta, scale)
            err = (ours.float() - ref.float()).abs().max().item()
            del ref
            t_ours = cuda_ms(lambda: paged_attention_triton(q, kc, vc, meta, scale), args.iters)  # noqa: B023
            t_ref = cuda_ms(lambda: paged_attention_ref(q, kc, vc, meta, scale), max(3, args.iters // 4))  # noqa: B023
            splits = decode_num_splits(batch, hkv, meta.block_tables.shape[1], args.block_size, device)
            kv_bytes = 2 * batch * ctx * hkv * d * kc.element_size()
            gbs = kv_bytes / (t_ours / 1e3) / 1e9
            print(f"{batch:>6} {ctx:>8} {splits:>6} {t_ours:>10.3f} {t_ref:>9.3f} {t_ref / t_ours:>7.1f}x "
                  f"{err:>8.1e} {gbs:>7,.0f} {gbs * 1e9 / bw:>6.0%}")
            del q, kc, vc, meta
            torch.cuda.empty_cache()

    b, chunk, ctx = args.prefill_batch, args.prefill_chunk, args.prefill_context
    q, kc, vc, meta = make_step([chunk] * b, [ctx] * b, h, hkv, d, args.block_size, dtype, device)
    ours = paged_attention_triton(q, kc, vc, meta, scale)
    err = (ours.float() - paged_attention_ref(q, kc, vc, meta, scale).float()).abs().max().item()
    t_ours = cuda_ms(lambda: paged_attention_triton(q, kc, vc, meta, scale), args.iters)
    t_ref = cuda_ms(lambda: paged_attention_ref(q, kc, vc, meta, scale), max(3, args.iters // 4))
    # Causal FLOPs: each query row sees (ctx - chunk + j + 1) keys; QK^T and PV are 2 * D FLOPs per key each.
    keys_seen = b * sum(ctx - chunk + j + 1 for j in range(chunk))
    tflops = 4 * d * h * keys_seen / (t_ours / 1e3) / 1e12
    print(f"\nchunked prefill: {b} requests x {chunk} new tokens on {ctx} keys\n"
          f"triton {t_ours:.3f} ms ({tflops:.0f} TFLOP/s), ref {t_ref:.3f} ms, speedup {t_ref / t_ours:.1f}x, "
          f"max err {err:.1e}")


if __name__ == "__main__":
    main()
