"""Micro-benchmark: one mixture-of-experts layer's experts on CUDA, INT4 (engine.kernels.triton_moe_int4
.fused_experts_int4, W4A16, dequantized in the kernel) vs bf16 (engine.kernels.triton_moe.fused_experts), both the
Triton grouped GEMMs the engine runs.

Usage:
    python -m bench.moe_int4                      # Qwen3-30B-A3B's layer: hidden 2048, experts of width 768, 128
                                                  # experts, top-8; g128; T = 1 32 256 2048
    python -m bench.moe_int4 --group-size 32 --tokens 1 8 --eager
    TRITON_INTERPRET=1 python -m bench.moe_int4 --device cpu --tiny   # smoke run of the script (interpreter times)

Random weights (std 0.02) are quantized round-to-nearest (min-max) per expert at --group-size; the bf16 kernel runs
on the same weights dequantized to bf16, so both compute the same layer and their outputs are compared first (max
abs difference over the largest output). Routing: route() (softmax then top-k, renormalized) on random logits.
Times: CUDA-event medians of one CUDA graph of --reps calls (the decode step runs in CUDA graphs; both paths have no
host sync), or with --eager launched one by one (bench.fused_ops.time_us). MB = the weight bytes the call must read
(the experts the routing picked, each read once: bf16 2 bytes a weight, INT4 half a byte plus a scale and a zero
per group), GB/s = MB over the time.
"""

from __future__ import annotations

import functools

import torch

from bench.common import new_parser, triton_device
from bench.fused_ops import time_us
from engine.layers.moe import route
from engine.loading.presets import preset_config
from engine.quant.qparams import quantize_int4
from engine.quant.stacked_int4 import StackedInt4

TINY = {"hidden": 64, "inter": 32, "experts": 8, "top_k": 2, "tokens": [1, 5]}


def random_experts(experts: int, out_f: int, in_f: int, group_size: int, device: torch.device,
                   gen: torch.Generator) -> StackedInt4:
    """`experts` random [out_f, in_f] weights (std 0.02, drawn on `device` by `gen`) quantized min-max at
    `group_size`, stacked (in one call: the groups run along in_f, so the experts' rows can share one [E * out_f,
    in_f])."""
    w = torch.randn(experts * out_f, in_f, generator=gen, device=device) * 0.02
    q = quantize_int4(w, group_size, method="minmax")
    return StackedInt4(q.qweight.view(experts, out_f, -1), q.scales.view(experts, out_f, -1),
                       q.zeros.view(experts, out_f, -1), in_f, group_size)


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="MoE model shape (engine.loading.presets)")
    ap.add_argument("--tiny", action="store_true", help=f"a tiny layer for a smoke run: {TINY}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128, 256])
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="rows T per call (default 1 32 256 2048)")
    ap.add_argument("--reps", type=int, default=10, help="calls per timing (per captured graph)")
    ap.add_argument("--iters", type=int, default=20, help="timings per measurement (the median is printed)")
    ap.add_argument("--eager", action="store_true", help="time eager launches instead of a CUDA graph")
    args = ap.parse_args()
    device = triton_device(args.device, "--device cpu --tiny")
    from engine.kernels.triton_moe import fused_experts
    from engine.kernels.triton_moe_int4 import fused_experts_int4, triton_moe_int4_ops

    if triton_moe_int4_ops() is None:
        raise SystemExit("the Triton MoE kernels are off here: triton does not import or TOKENMILL_TRITON_MOE=0")
    if args.tiny:
        hidden, inter, experts, top_k, tokens = (TINY[k] for k in ("hidden", "inter", "experts", "top_k", "tokens"))
    else:
        cfg = preset_config(args.preset)
        if cfg.num_experts < 1:
            raise SystemExit(f"preset {args.preset} has no experts; pick a MoE shape (e.g. qwen3-30b-a3b)")
        hidden, inter, experts, top_k = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                         cfg.num_experts_per_tok)
        tokens = [1, 32, 256, 2048]
    tokens = args.tokens or tokens
    dtype, group = getattr(torch, args.dtype), args.group_size
    gen = torch.Generator(device).manual_seed(0)
    gate_up = random_experts(experts, 2 * inter, hidden, group, device, gen)
    down = random_experts(experts, hidden, inter, group, device, gen)
    gate_up_dense, down_dense = gate_up.dequantize(dtype), down.dequantize(dtype)
    bytes_bf16 = 2 * 3 * inter * hidden  # one expert's weights
    bytes_int4 = 3 * inter * hidden // 2 + 2 * (2 * inter * -(-hidden // group) + hidden * (-(-inter // group))) * 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    import triton

    timing = "CPU wall time" if device.type != "cuda" else "eager" if args.eager else "CUDA graph"
    print(f"device={name} torch={torch.__version__} triton={triton.__version__} layer: hidden={hidden} "
          f"inter={inter} experts={experts} top_k={top_k} group={group} dtype={args.dtype} timing={timing} of "
          f"{args.reps} calls, median of {args.iters}")
    print(f"{'T':>5} {'experts':>7} {'bf16 us':>9} {'int4 us':>9} {'speedup':>8} {'bf16 MB':>8} {'int4 MB':>8} "
          f"{'bf16 GB/s':>10} {'int4 GB/s':>10} {'max|diff|/max':>14}")
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen, device=device).to(dtype)
        weights, ids = route(torch.randn(t, experts, generator=gen, device=device), top_k, "softmax_topk", True)
        weights = weights.to(dtype)
        active = int(torch.unique(ids).numel())
        with torch.inference_mode():
            ref = fused_experts(x, gate_up_dense, down_dense, ids, weights)
            out = fused_experts_int4(x, gate_up, down, ids, weights)
            diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us_dense = time_us(functools.partial(fused_experts, x, gate_up_dense, down_dense, ids, weights), device,
                               args.reps, args.iters, not args.eager)
            us_int4 = time_us(functools.partial(fused_experts_int4, x, gate_up, down, ids, weights), device,
                              args.reps, args.iters, not args.eager)
        mb_dense, mb_int4 = active * bytes_bf16 / 1e6, active * bytes_int4 / 1e6
        print(f"{t:>5} {active:>7} {us_dense:>9.1f} {us_int4:>9.1f} {us_dense / us_int4:>7.2f}x {mb_dense:>8.2f} "
              f"{mb_int4:>8.2f} {mb_dense / us_dense * 1e3:>10.0f} {mb_int4 / us_int4 * 1e3:>10.0f} {diff:>14.2e}")


if __name__ == "__main__":
    main()
