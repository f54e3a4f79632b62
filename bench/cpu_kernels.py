"""Micro-benchmarks of the CPU path's building blocks, at SmolLM2-135M's shapes (hidden 576, 9 query / 3 KV heads of
64, intermediate 1536, vocabulary 49,152).

Usage:
    python -m bench.cpu_kernels --gemm         # GFLOP/s: F.linear vs oneDNN-packed (engine.quant.packed_linear) vs W8A8
    python -m bench.cpu_kernels --attention    # ms per layer: decode attention, torch reference vs the C++ kernel
    python -m bench.cpu_kernels --prefill      # ms per layer: prefill attention, SDPA vs the C++ kernel
    python -m bench.cpu_kernels --argmax       # ms per step: greedy argmax of [B, 49152] logits, torch vs C++
    python -m bench.cpu_kernels --gguf         # us: gguf_linear on GGUF Q4_1/Q8_0 blocks vs oneDNN-packed fp32

--gemm: each projection and the LM head at M = 16, 64, 256, 1024 rows, fp32 and bf16, then INT8 W8A8
(engine.quant.int8_linear: the oneDNN int8 GEMM alone, and with the per-token activation quantization around it).
--attention: B decode requests with contexts of 64-160 tokens in a 30-layer KV pool (one cache per layer, cycled,
so the caches come from memory as in a real step, not from the L2), paged in 16-token blocks at shuffled ids.
--gguf: each projection (fused QKV and gate_up, Q4_1) and the LM head (Q8_0) at M = 1..32 rows (--gguf-rows), the
C++ gguf_linear (engine.kernels.gguf_blocks) against the oneDNN-packed fp32 GEMM of the same (dequantized) weight; each
projection's weights cycle through --layers copies and the LM head through 2, so they come from memory, as in a
decode step (30 layers of fp32 are 430 MB, of Q4_1 100 MB, against a 32 MB L3), not from the cache.
Medians of repeated calls on the threads torch uses (--threads).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import median_s, new_parser

SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}  # (K, N)


def bench_gemm(rows: list[int], reps: int) -> None:
    from engine.quant.int8_linear import Int8Linear, int8_available
    from engine.quant.packed_linear import PackedLinear

    print("| M | projection | fp32 F.linear | fp32 packed | bf16 F.linear | bf16 packed | int8 GEMM only "
          "| int8 W8A8 (bf16 in/out) |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for m in rows:
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, generator=gen) * 0.05
            x = torch.randn(m, k, generator=gen)
            flop = 2 * m * k * n / 1e9
            cells = []
            for dtype in (torch.float32, torch.bfloat16):
                wd, xd = w.to(dtype), x.to(dtype)
                packed = PackedLinear(wd)
                cells.append(flop / median_s(lambda wd=wd, xd=xd: F.linear(xd, wd), reps))
                cells.append(flop / median_s(lambda p=packed, xd=xd: p(xd), reps))
            if int8_available():
                lin = Int8Linear(w, torch.bfloat16)
                qx = torch.randint(0, 255, (m, k), dtype=torch.uint8, generator=gen)
                cells.append(flop / median_s(lambda lin=lin, qx=qx: torch.ops.onednn.qlinear_pointwise(
                    qx, 1.0, 128, lin.packed, lin.weight_scale, lin.weight_zero_point, None, 1.0, 0, torch.bfloat16,
                    "none", [], ""), reps))
                xb = x.bfloat16()
                cells.append(flop / median_s(lambda lin=lin, xb=xb: lin(xb), reps))
            print(f"| {m} | {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)


def bench_attention(batches: list[int], reps: int) -> None:
    from engine.kernels.cpu_kernels import cpu_ops
    from engine.layers.attention import AttentionMetadata, paged_attention_cpu, paged_attention_ref

    if cpu_ops() is None:
        sys.exit("the C++ kernels did not build here (see the warning)")
    heads, kv_heads, head_dim, block_size, layers = 9, 3, 64, 16, 30
    print("| batch | dtype | torch reference ms/layer | C++ kernel ms/layer | speedup | max abs diff |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        seq = torch.randint(64, 161, (b,), generator=gen)
        nb = [-(-int(s) // block_size) for s in seq]
        num_blocks = sum(nb)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        tables, width = [], max(nb)
        for n in nb:
            tables.append(perm[:n] + [0] * (width - n))
            perm = perm[n:]
        meta = AttentionMetadata(slot_mapping=torch.zeros(b, dtype=torch.int64),
                                 query_start_loc=torch.arange(b + 1, dtype=torch.int32),
                                 seq_lens=seq.to(torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
                                 query_lens=[1] * b, seq_lens_host=seq.tolist(), decode_only=True)
        for dtype in (torch.float32, torch.bfloat16):
            caches = [(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype),
                       torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype))
                      for _ in range(layers)]
            q = torch.randn(b, heads, head_dim, generator=gen).to(dtype)

            def run(fn: Callable[..., torch.Tensor], caches: list = caches, q: torch.Tensor = q,
                    meta: AttentionMetadata = meta) -> None:
                for kc, vc in caches:
                    fn(q, kc, vc, meta, 0.125)

            meta.plan = None
            ref_s = median_s(lambda: run(paged_attention_ref), reps) / layers
            ours_s = median_s(lambda: run(paged_attention_cpu), reps) / layers
            kc, vc = caches[0]
            diff = (paged_attention_cpu(q, kc, vc, meta, 0.125).float()
                    - paged_attention_ref(q, kc, vc, meta, 0.125).float()).abs().max().item()
            print(f"| {b} | {str(dtype).removeprefix('torch.')} | {ref_s * 1e3:.3f} | {ours_s * 1e3:.3f} "
                  f"| {ref_s / ours_s:.1f}x | {diff:.1e} |", flush=True)


def bench_prefill(lengths: list[int], reps: int) -> None:
    """Prefill attention per layer: SDPA over padded chunks (paged_attention_ref) vs the C++ kernel, for one prompt
    of each length, and for 16 prompts of 64-160 tokens in one step (a chat batch)."""
    from engine.kernels.cpu_kernels import cpu_ops
    from engine.layers.attention import AttentionMetadata, paged_attention_ref

    ops = cpu_ops()
    if ops is None:
        sys.exit("the C++ kernels did not build here (see the warning)")
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    print("| prompts x tokens | dtype | SDPA ms/layer | C++ kernel ms/layer | kernel / SDPA | max abs diff |")
    print("|---|---|---|---|---|---|")
    cases = [[n] for n in lengths] + [torch.randint(64, 161, (16,), generator=gen).tolist()]
    for lens in cases:
        nb = [-(-n // block_size) for n in lens]
        perm = torch.randperm(sum(nb), generator=gen).tolist()
        tables = []
        for n in nb:
            tables.append(perm[:n] + [0] * (max(nb) - n))
            perm = perm[n:]
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        for dtype in (torch.float32, torch.bfloat16):
            kc = torch.randn(sum(nb), block_size, kv_heads, head_dim, generator=gen).to(dtype)
            vc = torch.randn_like(kc)
            q = torch.randn(sum(lens), heads, head_dim, generator=gen).to(dtype)
            meta = AttentionMetadata(slot_mapping=torch.zeros(sum(lens), dtype=torch.int64),
                                     query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                     seq_lens=torch.tensor(lens, dtype=torch.int32),
                                     block_tables=torch.tensor(tables, dtype=torch.int32), query_lens=list(lens),
                                     seq_lens_host=list(lens), decode_only=False)
            sdpa_s = median_s(lambda q=q, kc=kc, vc=vc, meta=meta: paged_attention_ref(q, kc, vc, meta, 0.125), reps)
            ours_s = median_s(lambda q=q, kc=kc, vc=vc, meta=meta: ops.paged_attention(
                q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 0), reps)
            diff = (ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 0)
                    .float() - paged_attention_ref(q, kc, vc, meta, 0.125).float()).abs().max().item()
            label = f"1 x {lens[0]}" if len(lens) == 1 else f"{len(lens)} x {min(lens)}-{max(lens)}"
            print(f"| {label} | {str(dtype).removeprefix('torch.')} | {sdpa_s * 1e3:.2f} | {ours_s * 1e3:.2f} "
                  f"| {ours_s / sdpa_s:.2f} | {diff:.1e} |", flush=True)


def bench_argmax(batches: list[int], reps: int) -> None:
    """Greedy sampling's argmax over a step's logits [B, vocab], bf16 and fp32: torch.argmax vs the C++ kernel
    (engine.sample.sampler.argmax_rows)."""
    from engine.kernels.cpu_kernels import cpu_ops

    ops = cpu_ops()
    vocab = SHAPES["lm_head"][1]
    print("| dtype | rows B | torch.argmax ms | C++ argmax_rows ms | speed-up |")
    print("|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for b in batches:
            x = torch.randn(b, vocab).to(dtype)
            torch_s = median_s(lambda x=x: x.argmax(dim=-1), reps)
            ours_s = median_s(lambda x=x: ops.argmax_rows(x), reps)
            assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
            print(f"| {str(dtype).removeprefix('torch.')} | {b} | {torch_s * 1e3:.2f} | {ours_s * 1e3:.2f} "
                  f"| {torch_s / ours_s:.1f}x |", flush=True)


GGUF_SHAPES = {"qkv_proj": (960, 576, "Q4_1"), "o_proj": (576, 576, "Q4_1"), "gate_up_proj": (3072, 576, "Q4_1"),
               "down_proj": (576, 1536, "Q4_1"), "lm_head": (49152, 576, "Q8_0")}  # (N, K, GGUF type)


def random_blocks(n: int, k: int, type_name: str, gen: torch.Generator) -> object:
    """GGUFBlocks of a random weight [n, k] in a GGUF type, through gguf-py's own quantizer."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from engine.kernels.gguf_blocks import GGUFBlocks

    w = (torch.randn(n, k, generator=gen) * 0.05).numpy().astype(np.float32)
    return GGUFBlocks.from_raw(quantize(w, GGMLQuantizationType[type_name]), type_name, (n, k))


def bench_gguf(rows: list[int], reps: int, layers: int) -> None:
    """Microseconds per GEMM, gguf_linear vs the oneDNN-packed fp32 GEMM, per projection and M; then per M the
    sum over one layer's four projections plus the LM head, and the ratio."""
    from engine.kernels.cpu_kernels import cpu_ops
    from engine.kernels.gguf_blocks import gguf_linear
    from engine.quant.packed_linear import PackedLinear

    if cpu_ops() is None:
        sys.exit("the C++ kernels did not build here (see the warning)")
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, (n, k, type_name) in GGUF_SHAPES.items():
        copies = 2 if name == "lm_head" else layers
        blocks = [random_blocks(n, k, type_name, gen) for _ in range(min(copies, 2))]
        blocks = [blocks[i % len(blocks)].map_rows(lambda t: t.clone()) for i in range(copies)]
        weights[name] = (blocks, [PackedLinear(b.dequantize()) for b in blocks])
    print("| M | " + " | ".join(f"{name} ({GGUF_SHAPES[name][2]}) ours / fp32 packed" for name in GGUF_SHAPES)
          + " | layer ours / fp32 packed us | fp32 / ours | layer + LM head ours / fp32 packed us | fp32 / ours |")
    print("|---|" + "---|" * (len(GGUF_SHAPES) + 4))
    for m in rows:
        cells, ours_sum, packed_sum = [], 0.0, 0.0
        for name, (k_blocks, k_packed) in weights.items():
            x = torch.randn(m, GGUF_SHAPES[name][1], generator=gen)
            diff = (gguf_linear(x, k_blocks[0]) - k_packed[0](x)).abs().max().item()
            if diff > 1e-3:
                sys.exit(f"gguf_linear differs from the fp32 GEMM by {diff} at M={m}, {name}")
            ours = median_s(lambda x=x, bs=k_blocks: [gguf_linear(x, b) for b in bs], reps) / len(k_blocks) * 1e6
            packed = median_s(lambda x=x, ps=k_packed: [p(x) for p in ps], reps) / len(k_packed) * 1e6
            cells.append(f"{ours:.0f} / {packed:.0f}")
            if name == "lm_head":
                cells.append(f"{ours_sum:.0f} / {packed_sum:.0f} | {packed_sum / ours_sum:.2f}")  # the layer alone
            ours_sum += ours
            packed_sum += packed
        print(f"| {m} | " + " | ".join(cells) + f" | {ours_sum:.0f} / {packed_sum:.0f} | {packed_sum / ours_sum:.2f} |",
              flush=True)


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--argmax", action="store_true")
    ap.add_argument("--gguf", action="store_true")
    ap.add_argument("--gguf-rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    ap.add_argument("--layers", type=int, default=30, help="--gguf: copies of each projection's weights")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    every = not (args.gemm or args.attention or args.prefill or args.argmax or args.gguf)
    if args.gemm or every:
        bench_gemm(args.rows, args.reps)
    if args.attention or every:
        bench_attention(args.batches, args.reps)
    if args.prefill or every:
        bench_prefill(args.lengths, args.reps)
    if args.argmax or every:
        bench_argmax(args.batches, args.reps)
    if args.gguf or every:
        bench_gguf(args.gguf_rows, args.reps, args.layers)


if __name__ == "__main__":
    main()
