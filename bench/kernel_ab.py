"""A/B of two builds of the C++ CPU kernels (engine/kernels/csrc/cpu_kernels.cpp) in one process: this tree's and the
one
at git revision --rev, per op (silu_and_mul, quantize_rows_u8, argmax_rows), per layer (decode attention) and in the
whole engine (both builds loaded, swapped between runs in every module that calls `cpu_ops`: attention, RMSNorm and
the layers' fused ops, the sampler). One thread, CPU seconds (`time.process_time`): robust to other work on
the machine. The figures of bench/README.md "AVX2-only CPUs, second session".

Usage:
    python -m bench.kernel_ab --rev f95af2a                 # per-op and per-layer tables, then 64 AlpacaEval +
                                                            # 64 GSM8K rows (fp32) and 64 AlpacaEval (--int8)
    python -m bench.kernel_ab --rev f95af2a --no-engine
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

import engine.layers.attention as attention
from bench.common import ROOT, best_seconds, new_parser
from engine.kernels.cpu_kernels import CFLAGS, SOURCES

# (rows, shortest context, longest context + 1, heads, KV heads, head_dim)
CASES = [(16, 64, 161, 9, 3, 64), (64, 64, 161, 9, 3, 64), (64, 300, 601, 9, 3, 64), (256, 64, 161, 9, 3, 64),
         (32, 200, 401, 32, 8, 128)]


def build(tag: str, source: Path) -> ModuleType:
    """Compile one kernels source as its own extension module (named by its hash)."""
    from torch.utils.cpp_extension import load

    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    return load(f"tokenmill_ab_{tag}_{digest}", [str(source)], extra_cflags=CFLAGS, verbose=False)


def best_cpu_s(fn: Callable[[], object], reps: int = 5) -> float:
    """Least CPU seconds of reps calls (after one warm-up)."""
    return best_seconds(fn, reps, time.process_time)


def attend_layers(mod: ModuleType, q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
                  tables: torch.Tensor, lens: torch.Tensor, qsl: torch.Tensor) -> None:
    """One decode step's attention over every layer's caches (q [B, H, D] fp32, caches [blocks, 16, KV, D])."""
    for kc, vc in caches:
        mod.paged_attention(q, kc, vc, tables, lens, qsl, q.shape[-1] ** -0.5, 0)


def per_op(mods: dict[str, ModuleType]) -> None:
    """The elementwise ops at SmolLM2-135M's shapes (fp32): SwiGLU's silu(gate) * up [T, 2 x 1536], the per-token
    int8 quantization of [T, 576] activations (W8A8) and greedy argmax of [T, 49152] logits; results compared."""
    print("| op | rows | base us | this us | speed-up | same result |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for t in (64, 256):
        gate_up, x, logits = (torch.randn(t, 3072, generator=gen), torch.randn(t, 576, generator=gen),
                              torch.randn(t, 49152, generator=gen))
        for name, call in (("silu_and_mul", lambda m, a=gate_up: m.silu_and_mul(a)),
                           ("quantize_rows_u8", lambda m, a=x: m.quantize_rows_u8(a)),
                           ("argmax_rows", lambda m, a=logits: m.argmax_rows(a))):
            us = {tag: best_cpu_s(functools.partial(call, m)) * 1e6 for tag, m in mods.items()}
            a, b = call(mods["base"]), call(mods["this"])
            same = all(torch.equal(u, v) for u, v in zip(a, b, strict=True)) if isinstance(a, (list, tuple)) \
                else torch.equal(a, b)
            print(f"| {name} | {t} | {us['base']:.0f} | {us['this']:.0f} | {us['base'] / us['this']:.2f}x "
                  f"| {same} |", flush=True)


def use_kernels(mod: ModuleType) -> None:
    """Route every caller of the kernels in the engine to `mod`."""
    import engine.layers.rms_norm as rms_norm
    import engine.sample.sampler as sampler

    for module in (attention, rms_norm, sampler):
        module.cpu_ops = lambda mod=mod: mod


def per_layer(mods: dict[str, ModuleType], layers: int = 8) -> None:
    """Decode attention per layer: random fp32 caches through random block tables, `layers` layers' worth (so
    the caches do not all sit in L2, as in a real step)."""
    print("| rows | context | heads/KV/head_dim | base ms | this ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for b, lo, hi, heads, kv, hd in CASES:
        gen = torch.Generator().manual_seed(0)
        seq = torch.randint(lo, hi, (b,), generator=gen)
        nb = [-(-int(s) // 16) for s in seq]
        perm = torch.randperm(sum(nb), generator=gen).tolist()
        tables = []
        for n in nb:
            tables.append(perm[:n] + [0] * (max(nb) - n))
            perm = perm[n:]
        bt = torch.tensor(tables, dtype=torch.int32)
        caches = [(torch.randn(sum(nb), 16, kv, hd, generator=gen), torch.randn(sum(nb), 16, kv, hd, generator=gen))
                  for _ in range(layers)]
        q = torch.randn(b, heads, hd, generator=gen)
        qsl, lens = torch.arange(b + 1, dtype=torch.int32), seq.to(torch.int32)
        ms = {tag: best_cpu_s(functools.partial(attend_layers, m, q, caches, bt, lens, qsl)) / layers * 1e3
              for tag, m in mods.items()}
        kc, vc = caches[0]
        diff = (mods["this"].paged_attention(q, kc, vc, bt, lens, qsl, hd ** -0.5, 0)
                - mods["base"].paged_attention(q, kc, vc, bt, lens, qsl, hd ** -0.5, 0)).abs().max().item()
        print(f"| {b} | {lo}-{hi - 1} | {heads}/{kv}/{hd} | {ms['base']:.2f} | {ms['this']:.2f} "
              f"| {ms['base'] / ms['this']:.2f}x | {diff:.1e} |", flush=True)


def whole_engine(mods: dict[str, ModuleType], max_tokens: int, quantization: str = "none") -> None:
    """64 AlpacaEval and 64 GSM8K prompts (AlpacaEval only with int8), chat template, greedy, max_tokens forced
    tokens, each build twice, interleaved."""
    import pyarrow.parquet as pq

    from engine import EngineConfig, LLMEngine, SamplingParams

    data = ROOT.parent / "shared" / "data"
    alpaca = pq.read_table(data / "alpaca_eval.parquet").column("instruction").to_pylist()[:64]
    gsm8k = pq.read_table(data / "gsm8k_test.parquet").column("question").to_pylist()[:64]
    eng = LLMEngine.from_model(None, EngineConfig(device="cpu", quantization=quantization))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    workloads = [("64 AlpacaEval", alpaca)] + ([("64 GSM8K", gsm8k)] if quantization == "none" else [])
    best: dict[tuple[str, str], float] = {}
    for _ in range(2):
        for name, prompts in workloads:
            for tag, mod in mods.items():
                use_kernels(mod)
                t = time.process_time()
                outs = eng.generate([[{"role": "user", "content": p}] for p in prompts], params)
                rate = sum(o.num_output_tokens for o in outs) / (time.process_time() - t)
                eng.reset_prefix_cache()
                best[(name, tag)] = max(best.get((name, tag), 0.0), rate)
    print(f"| prompts (quantization {quantization}) | base tok per CPU s | this tok per CPU s | this / base |")
    print("|---|---|---|---|")
    for name, _ in workloads:
        b, t = best[(name, "base")], best[(name, "this")]
        print(f"| {name} | {b:.1f} | {t:.1f} | {t / b:.2f}x |")


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rev", required=True, help="git revision of the base build")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-engine", action="store_true", help="the per-op and per-layer tables only")
    ap.add_argument("--int8", action="store_true", help="the whole engine with --quantization int8 too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rel = SOURCES[0].relative_to(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        base_src = Path(tmp) / "cpu_kernels.cpp"
        base_src.write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{args.rev}:{rel}"],
                                            capture_output=True, check=True).stdout)
        mods = {"base": build("base", base_src), "this": build("this", SOURCES[0])}
    print(f"kernels at {args.rev} (base) vs this tree (this); one thread; CPU seconds", flush=True)
    per_op(mods)
    per_layer(mods)
    if not args.no_engine:
        whole_engine(mods, args.max_tokens)
        if args.int8:
            whole_engine(mods, args.max_tokens, "int8")


if __name__ == "__main__":
    main()
