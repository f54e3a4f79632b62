"""The fp32 GEMM floor of a CPU workload: how fast any engine doing its linear-layer FLOPs in fp32 could be here.

Usage:
    python -m bench.cpu_roof                          # w1: 64 AlpacaEval prompts, chat template, 64 output tokens
    python -m bench.cpu_roof --workload c256 --threads 2

For the workload of bench/peers.py (same prompts, same token counts) it counts the FLOPs of the model's linear
layers (Q/K/V, O, gate/up, down, and the LM head once per sampled token) that our engine runs: every prompt token
once, less the KV blocks the batch's prompts share (in-batch prefix caching, at the engine's block size), then one
token per request per decode step. It then times those GEMMs here: oneDNN's packed fp32 GEMM
(engine.quant.packed_linear.PackedLinear) on the model's real shapes, at the decode step's rows M (the batch) and at a
prefill chunk's, through 30 distinct layers' weights (cold in cache, as in a step) and the LM head, and prints
    floor_s         the linear layers' time alone, at the measured GEMM rates (attention, norms, sampling free)
    max_tok_s       output tokens / floor_s: no fp32 engine on these GEMMs makes more
    needed_tok_s    --target x --peer-tok-s (what a target ratio over a peer asks for), when given
CTranslate2 and HF do at least these FLOPs (they share no prompt prefix), so `max_tok_s / peer_tok_s` bounds the
ratio any fp32 engine could show over that peer on this machine. Machine: report the CPU flags line it prints.
"""

from __future__ import annotations

import json
import time

import torch

from bench.common import new_parser
from bench.peers import WORKLOADS, build_prompts, cpu_model_name, cpu_simd_flags


def prefill_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Prompt tokens our engine computes for one batch: all of them, less whole KV blocks of a prefix that an
    earlier prompt of the batch already holds (automatic prefix caching counts full blocks only)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for p in prompts:
        full = (len(p) - 1) // block_size  # the block holding the last prompt token is always computed
        shared = 0
        while shared < full and tuple(p[:(shared + 1) * block_size]) in seen:
            shared += 1
        for b in range(1, full + 1):
            seen.add(tuple(p[:b * block_size]))
        total += len(p) - shared * block_size
    return total


def gemm_seconds(shapes: list[tuple[int, int]], layers: int, rows: int, reps: int) -> float:
    """Seconds of one pass of `rows` rows through `layers` distinct copies of the layer GEMMs `shapes` (N, K),
    oneDNN packed fp32, median of `reps` passes after one warm-up pass."""
    from engine.quant.packed_linear import PackedLinear

    weights = [[PackedLinear(torch.randn(n, k) * 0.02) for n, k in shapes] for _ in range(layers)]
    xs = {k: torch.randn(rows, k) for _, k in shapes}
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        for layer in weights:
            for (_, k), lin in zip(shapes, layer, strict=True):
                lin(xs[k])
        if rep:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--peer-tok-s", type=float, default=None, help="a peer's measured output tok/s")
    ap.add_argument("--target", type=float, default=2.0, help="the ratio over the peer to check")
    args = ap.parse_args()
    from engine import EngineConfig
    from engine.loading.gguf_file import open_gguf, read_gguf_config
    from engine.loading.model_files import resolve_model_path
    from engine.text.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(None)
    cfg = read_gguf_config(open_gguf(path))
    n = args.num_prompts or WORKLOADS[args.workload]
    prompts = build_prompts(Tokenizer.from_gguf(path), args.workload, n)
    block, budget = EngineConfig().block_size, EngineConfig().max_num_batched_tokens
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = [((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), (h, cfg.num_heads * d), (2 * cfg.intermediate_size, h),
              (h, cfg.intermediate_size)]
    per_token = 2 * cfg.num_layers * sum(a * b for a, b in shapes)
    lm_head = 2 * h * cfg.vocab_size
    pre = prefill_tokens(prompts, block)
    out = n * args.max_tokens
    flops = pre * per_token + out * lm_head + n * (args.max_tokens - 1) * per_token
    # Time: decode steps at M = n rows; prefill in chunks of the step budget (its rate at M = budget).
    decode_layers = gemm_seconds(shapes, cfg.num_layers, n, args.reps)
    prefill_layers = gemm_seconds(shapes, cfg.num_layers, budget, max(1, args.reps // 2)) * pre / budget
    head = gemm_seconds([(cfg.vocab_size, h)], 1, n, args.reps)
    floor = prefill_layers + (args.max_tokens - 1) * decode_layers + args.max_tokens * head
    row = {"device": cpu_model_name(), "cpu_flags": cpu_simd_flags(), "threads": torch.get_num_threads(),
           "workload": args.workload, "requests": n, "prompt_tokens": sum(map(len, prompts)),
           "prefill_tokens_computed": pre, "output_tokens": out, "linear_gflop": round(flops / 1e9, 1),
           "decode_step_gemm_ms": round(1e3 * (decode_layers + head), 1),
           "decode_gflop_s": round(n * (per_token + lm_head) / (decode_layers + head) / 1e9, 1),
           "floor_s": round(floor, 2), "max_tok_s": round(out / floor, 1)}
    if args.peer_tok_s:
        row["needed_tok_s"] = round(args.target * args.peer_tok_s, 1)
        row["max_ratio_over_peer"] = round(out / floor / args.peer_tok_s, 2)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
