"""A mixture-of-experts step's expert computation on the CPU against one dense GEMM pair of the same FLOPs (issue 43).

MoE: engine.layers.moe.SparseMoE.forward on T tokens (the router, the rows sorted by expert, each active expert's
fused gate/up and down GEMMs on oneDNN-packed weights, SiLU-and-mul, the weighted sum back per token), fused and
packed as the engine serves it (pack_linears). Dense: the same T * k rows through one packed gate/up [2I, hidden]
GEMM, SiLU-and-mul and one packed down [hidden, I] GEMM: the experts' FLOPs as a single GEMM pair, the bound a
grouped computation aims at. Reported: ms per call (the best of --reps, the two sides interleaved), ratio MoE / dense
(target <= 1.3 where each expert gets enough rows to be compute-bound; at decode sizes the experts' weights, not
FLOPs, set the time: T = 32 tokens at top-8 reach almost every expert, each for about 4 rows).

The default shape is Qwen3-30B-A3B's expert geometry scaled to a 2-core machine's cache and memory: hidden 1024,
expert width 384 (Qwen3-30B-A3B: 2048, 768), 64 experts, top-8 (Qwen3: 128, top-8). Each call's experts come from
memory as in a model (--layers copies cycled; 4 layers of the default shape are 300 MB of fp32).

Usage:
    python -m bench.moe_cpu                                  # bf16 and fp32, T = 32, 128, 512, 2048
    python -m bench.moe_cpu --dtype bfloat16 --tokens 512 --experts 128 --hidden 2048 --inter 768
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.config import ModelConfig
from engine.kernels.cpu_kernels import cpu_ops
from engine.layers.moe import SparseMoE
from engine.layers.rms_norm import fused_ops
from engine.quant.after_load import pack_linears
from engine.quant.packed_linear import PackedLinear, can_pack


def moe_blocks(args: argparse.Namespace, dtype: torch.dtype) -> list[SparseMoE]:
    """--layers SparseMoE blocks of random N(0, 0.02) weights, fused and oneDNN-packed."""
    cfg = ModelConfig(vocab_size=32, hidden_size=args.hidden, intermediate_size=args.inter, num_layers=1,
                      num_heads=8, num_kv_heads=8, head_dim=args.hidden // 8, num_experts=args.experts,
                      num_experts_per_tok=args.top_k, moe_intermediate_size=args.inter, router="softmax_topk",
                      norm_topk_prob=True)
    blocks = []
    for _ in range(args.layers):
        block = SparseMoE(cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
        block = block.to(dtype).eval()
        block.fuse()
        pack_linears(block)
        blocks.append(block)
    return blocks


def dense_pairs(args: argparse.Namespace, dtype: torch.dtype) -> list[tuple[PackedLinear, PackedLinear]]:
    """--layers packed (gate/up [2I, hidden], down [hidden, I]) GEMM pairs: one expert's shape, cycled alike."""
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k) * 0.02).to(dtype)

    return [(PackedLinear(w(2 * args.inter, args.hidden)), PackedLinear(w(args.hidden, args.inter)))
            for _ in range(args.layers)]


def swiglu_pair(pair: tuple[PackedLinear, PackedLinear], x: torch.Tensor) -> torch.Tensor:
    gate_up = pair[0](x)
    return pair[1](fused_ops(gate_up).silu_and_mul(gate_up))


def best_ms(fns: list, calls: int, reps: int) -> list[float]:
    """For each fn: the best over `reps` of the mean ms of `calls` calls fn(i) (i cycles the layers), the fns'
    repetitions interleaved, so that load from other processes on a shared machine hits all alike; the best, not the
    median, because such load only ever adds time."""
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 1):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            if rep:  # the first round warms up (oneDNN builds a kernel per new row count)
                out.append((time.perf_counter() - t0) * 1e3 / calls)
    return [min(t) for t in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    p.add_argument("--tokens", default="32,512,2048", help="tokens T per step, comma-separated")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=384, help="one expert's SwiGLU width")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="copies cycled so weights come from memory")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if cpu_ops() is None:
        raise SystemExit("the C++ kernels (engine.kernels.cpu_kernels) did not build; both sides use silu_and_mul")
    dtypes = ["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; hidden {args.hidden}, expert width "
          f"{args.inter}, {args.experts} experts, top-{args.top_k}, {args.layers} layers cycled")
    print("| dtype | T | rows T*k | active experts | MoE ms | dense ms | MoE / dense |")
    print("|---|---|---|---|---|---|---|")
    for name in dtypes:
        dtype = getattr(torch, name)
        if not can_pack(dtype):
            print(f"| {name} | oneDNN cannot pack {name} here |")
            continue
        blocks, pairs = moe_blocks(args, dtype), dense_pairs(args, dtype)
        for t in (int(v) for v in args.tokens.split(",")):
            x = (torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t))).to(dtype)
            rows = x.repeat_interleave(args.top_k, dim=0)  # the dense side's T * k rows
            with torch.inference_mode():
                active = len(set(blocks[0].gate(x).topk(args.top_k, dim=-1).indices.reshape(-1).tolist()))
                moe, dense = best_ms([lambda i, x=x, b=blocks: b[i % args.layers](x),
                                      lambda i, r=rows, p=pairs: swiglu_pair(p[i % args.layers], r)],
                                     args.layers, args.reps)
            print(f"| {name} | {t} | {t * args.top_k} | {active} | {moe:.2f} | {dense:.2f} | {moe / dense:.2f}x |")


if __name__ == "__main__":
    main()
