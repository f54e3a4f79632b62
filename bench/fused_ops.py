"""Micro-benchmark: the decoder's elementwise ops on CUDA, torch fallback vs the Triton fused kernels
(engine.kernels.triton_fused), at a model shape's sizes.

Usage:
    python -m bench.fused_ops                                # Llama-3.1-8B shape, bf16, T = 1 64 512 2048
    python -m bench.fused_ops --preset qwen2.5-7b --tokens 256 --eager
    TRITON_INTERPRET=1 python -m bench.fused_ops --device cpu --preset tiny-smollm2 --tokens 1 5   # smoke run

Per op and token count T: the torch path the model runs without the fused ops (engine/layers/rms_norm.py RMSNorm._norm,
the residual add, engine/layers/rope.py apply_rope + engine/layers/attention.py write_kv, F.silu(gate) * up) and the
Triton op,
each checked against the other first (max abs difference), then timed: CUDA-event medians of one CUDA graph of
--reps calls (the decode step runs in CUDA graphs, so no launch cost; inputs stay in L2 where they fit), or with
--eager launched one by one. Prints us per call, the speedup, and the bytes the op must move (its inputs read once,
its outputs written once) over the time as GB/s. Then per T the sum over one forward pass: num_layers x (rms_norm,
rope_write_kv, add_rms_norm, silu_and_mul) + the final norm, torch vs Triton, the "other" kernels the fusion
replaces (bench/gpu_profile.py's table).

On the CPU (TRITON_INTERPRET=1, --device cpu) the times are the interpreter's: a smoke run of the script only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import cuda_ms, median_s, new_parser, triton_device
from engine.config import ModelConfig
from engine.layers.attention import write_kv
from engine.layers.rms_norm import RMSNorm
from engine.layers.rope import apply_rope
from engine.loading.presets import preset_config

BLOCK_SIZE = 16
OPS = ("rms_norm", "add_rms_norm", "rope_write_kv", "silu_and_mul")


def time_us(fn: Callable[[], object], device: torch.device, reps: int, iters: int, graph: bool) -> float:
    """Median time of one fn() call in microseconds: over `iters` CUDA-event timings of a CUDA graph of `reps`
    calls (graph) or of `reps` eager calls; on the CPU the wall time of `reps` calls."""
    fn()  # compile, autotune, allocate
    if device.type != "cuda":
        return median_s(lambda: [fn() for _ in range(reps)], iters, warmup=0) / reps * 1e6
    torch.cuda.synchronize()
    run: Callable[[], object]
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run = g.replay
    else:
        def run() -> None:
            for _ in range(reps):
                fn()
    return cuda_ms(run, iters, warmup=1) * 1e3 / reps


def make_ops(t: int, cfg: ModelConfig, norm: RMSNorm, dtype: torch.dtype, device: torch.device
             ) -> tuple[dict[str, tuple[Callable[[], object], Callable[[], object], int]], Callable[[], float]]:
    """The four ops at T = t on random inputs: name -> (torch path, Triton op, bytes the op must move), and a check
    of the K rows the last Triton rope_write_kv call stored (max abs difference from the torch path's RoPE)."""
    from engine.kernels import triton_fused

    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    elt = torch.empty((), dtype=dtype).element_size()
    x = (torch.randn(t, hidden) * 2).to(device=device, dtype=dtype)
    residual = (torch.randn(t, hidden) * 4).to(device=device, dtype=dtype)
    gate_up = (torch.randn(t, 2 * inter) * 3).to(device=device, dtype=dtype)
    qkv = torch.randn(t, (h + 2 * hkv) * d).to(device=device, dtype=dtype)
    positions = torch.randint(0, 4096, (t,))
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([positions[:, None].float() * inv_freq[None, :]] * 2, dim=-1)
    cos, sin = emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
    num_blocks = -(-t // BLOCK_SIZE) * 2 + 1
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, hkv, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE)[:t].to(device)

    def rope_torch() -> torch.Tensor:
        qk = apply_rope(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), cos, sin)
        write_kv(qk[:, h:], qkv[:, (h + hkv) * d:].view(t, hkv, d), k_cache, v_cache, slots)
        return qk[:, :h]

    def add_norm_torch() -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x
        return norm._norm(total), total

    def silu_torch() -> torch.Tensor:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

    ops: dict[str, tuple[Callable[[], object], Callable[[], object], int]] = {
        "rms_norm": (lambda: norm._norm(x), lambda: triton_fused.rms_norm(x, norm.weight, norm.eps),
                     (2 * t + 1) * hidden * elt),
        "add_rms_norm": (add_norm_torch, lambda: triton_fused.add_rms_norm(x, residual, norm.weight, norm.eps),
                         (4 * t + 1) * hidden * elt),
        "rope_write_kv": (rope_torch, lambda: triton_fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots,
                                                                         h),
                          (2 * t * (h + 2 * hkv) * d + 2 * t * d) * elt + 8 * t),
        "silu_and_mul": (silu_torch, lambda: triton_fused.silu_and_mul(gate_up), 3 * t * inter * elt),
    }

    def k_rows_diff() -> float:
        k_ref = apply_rope(qkv[:, :(h + hkv) * d].view(t, h + hkv, d), cos, sin)[:, h:]
        return (k_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE].float() - k_ref.float()).abs().max().item()

    return ops, k_rows_diff


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-3.1-8b", help="model shape (engine.loading.presets)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 2048], help="rows T per call")
    ap.add_argument("--reps", type=int, default=10, help="calls per timing (per captured graph)")
    ap.add_argument("--iters", type=int, default=20, help="timings per measurement (the median is printed)")
    ap.add_argument("--eager", action="store_true", help="time eager launches instead of a CUDA graph")
    args = ap.parse_args()
    device = triton_device(args.device, "--device cpu")
    from engine.kernels import triton_fused

    if triton_fused.triton_fused_ops() is None:
        raise SystemExit("the Triton fused ops are off here: triton does not import or TOKENMILL_TRITON_FUSED=0")
    cfg = preset_config(args.preset)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(cfg.hidden_size) + 0.5)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    import triton

    timing = "CPU wall time" if device.type != "cuda" else "eager" if args.eager else "CUDA graph"
    print(f"device={device_name} torch={torch.__version__} triton={triton.__version__} preset={args.preset} "
          f"dtype={args.dtype} timing={timing} of {args.reps} calls, median of {args.iters}")
    print(f"{'op':<14} {'T':>5} {'torch us':>10} {'triton us':>10} {'speedup':>8} {'MB':>8} {'triton GB/s':>12} "
          f"{'torch GB/s':>11} {'max|diff|':>10}")
    per_forward: dict[int, tuple[float, float]] = {}
    counts = {"rms_norm": cfg.num_layers + 1, "add_rms_norm": cfg.num_layers, "rope_write_kv": cfg.num_layers,
              "silu_and_mul": cfg.num_layers}
    for t in args.tokens:
        ops, k_rows_diff = make_ops(t, cfg, norm, dtype, device)
        sums = [0.0, 0.0]
        with torch.inference_mode():
            for name in OPS:
                torch_fn, triton_fn, nbytes = ops[name]
                ref, out = torch_fn(), triton_fn()
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(
                    ref if isinstance(ref, tuple) else (ref,), out if isinstance(out, tuple) else (out,),
                    strict=True))
                if name == "rope_write_kv":  # and the K rows it stored in the cache
                    diff = max(diff, k_rows_diff())
                us_torch = time_us(torch_fn, device, args.reps, args.iters, not args.eager)
                us_triton = time_us(triton_fn, device, args.reps, args.iters, not args.eager)
                sums[0] += counts[name] * us_torch
                sums[1] += counts[name] * us_triton
                print(f"{name:<14} {t:>5} {us_torch:>10.1f} {us_triton:>10.1f} {us_torch / us_triton:>7.2f}x "
                      f"{nbytes / 1e6:>8.2f} {nbytes / us_triton / 1e3:>12.0f} {nbytes / us_torch / 1e3:>11.0f} "
                      f"{diff:>10.2e}")
        per_forward[t] = (sums[0], sums[1])
    print(f"\nper forward pass ({cfg.num_layers} layers x (rms_norm, rope_write_kv, add_rms_norm, silu_and_mul) + the "
          "final norm):")
    for t, (a, b) in per_forward.items():
        print(f"  T={t:<5} torch {a / 1e3:8.3f} ms   triton {b / 1e3:8.3f} ms   saved {(a - b) / 1e3:8.3f} ms "
              f"({a / b:.2f}x)")


if __name__ == "__main__":
    main()
