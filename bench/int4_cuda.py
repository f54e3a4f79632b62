"""The CUDA half of bench/int4.py (`python -m bench.int4 --device cuda`; its docstring says what is measured):
the kernel sweep of one layer's GEMMs by M (bf16, tinygemm, dequantize-then-GEMM, GemLite as we set it up, as it
sets itself up and after its full autotune) and the start-up and decode throughput of bf16 vs INT4 engines."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import emit


def _time_us(fn: object, device: torch.device, reps: int = 20) -> tuple[float, str]:
    """Mean microseconds per call of `fn` and how they were taken: on CUDA, `reps` calls captured in one CUDA graph
    and replayed (the decode steps run as graphs, so launch and Python overhead are left out, as there), or eager
    when capture fails; on the CPU, eager. Three eager calls first (Triton autotuning and lazy init)."""
    for _ in range(3):
        fn()  # type: ignore[operator]
    if device.type == "cuda":
        torch.cuda.synchronize()
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn()  # type: ignore[operator]
            graph.replay()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            return round((time.perf_counter() - t) / (5 * reps) * 1e6, 1), "graph"
        except RuntimeError:
            torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return round((time.perf_counter() - t) / reps * 1e6, 1), "eager"


def projection_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of one decoder layer's GEMMs as the engine serves them (fused QKV and gate/up): engine.loading.presets."""
    from engine.loading.presets import preset_config

    c = preset_config(preset)
    head_dim = c.head_dim or c.hidden_size // c.num_heads
    return {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * head_dim, c.hidden_size),
            "o": (c.hidden_size, c.num_heads * head_dim), "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size)}


#: GemLite set-ups the CUDA sweep times: "gemlite" = ours (engine.quant.gemlite_int4.tune_gemlite: gemlite's
#: shipped file of the same chip, our per-GPU cache, "fast" autotune of what they miss, all before the timing);
#: "gemlite_default" = gemlite as it sets itself up (its shipped file if the GPU's name has one, else "fast"
#: autotune on the first call: what the H200 run of 2026-11-26 timed); "gemlite_max" = gemlite's full autotune
#: from scratch ("max": 120 configs a key for GEMV_REVSPLITK, 1240-1970 for GEMM_SPLITK, 360-500 for GEMM at
#: the Llama-3.1-8B shapes, counted with its pruner; about a second of compile each), only at --gemlite-max-rows.
GEMLITE_SETUPS = ("gemlite", "gemlite_default", "gemlite_max")


def _setup_gemlite(setup: str) -> None:
    """Put gemlite in one of GEMLITE_SETUPS (before its modules are built): autotune mode (set_autotune reloads its
    kernel modules, so no key tuned before survives) and the config files loaded."""
    import gemlite

    from engine.quant.gemlite_tuning import gemlite_own_config

    gemlite.set_autotune("max" if setup == "gemlite_max" else "fast")
    gemlite.reset_config()
    if setup == "gemlite_default":
        shipped = Path(gemlite.__file__).parent / "configs"
        own = gemlite_own_config(torch.cuda.get_device_name(), [p.stem for p in shipped.glob("*.json")])
        if own is not None:
            gemlite.load_config(str(shipped / f"{own}.json"))


def kernel_sweep(dev: torch.device, shapes: dict[str, tuple[int, int]], rows: list[int], group_size: int = 128,
                 dtype: torch.dtype = torch.bfloat16, gemlite_max_rows: tuple[int, ...] = ()) -> int | None:
    """INT4 kernels against the dense GEMM on `shapes` (N, K) by rows M: dense (F.linear in `dtype`), tinygemm,
    dequantize-then-GEMM and, on CUDA, GemLite in each of GEMLITE_SETUPS (gemlite_max only at gemlite_max_rows),
    each an Int4Linear pinned to that kernel (a kernel Int4Linear would not run at that M on this device, e.g.
    dequant for bf16 on the CPU, is left out: 0 in the table). GemLite's start-up cost is printed per set-up and
    shape: `tune_s` (ours: tune_gemlite before timing) and `first_call_ms` per M (gemlite's own set-ups tune there).
    One JSON line per (shape, M, kernel) as it is timed (a sweep cut short keeps them), then a table of the layer
    totals (the sum over the shapes) and the crossovers: the largest M at which tinygemm beats our GemLite
    (engine.quant.int4_kernel_plan.CUDA_TINYGEMM_MAX_ROWS), the smallest from which dequantize + GEMM does
    (CUDA_GEMLITE_DEQUANT_MIN_ROWS) and where the best INT4 kernel is at or below dense. Returns that tinygemm
    crossover (None when GemLite did not run)."""
    from engine.quant.gemlite_int4 import gemlite_unavailable_reason
    from engine.quant.gemlite_tuning import tune_gemlite
    from engine.quant.int4_linear import Int4Linear
    from engine.quant.qparams import quantize_int4

    gemlite_ok = dev.type == "cuda" and gemlite_unavailable_reason() is None
    if dev.type == "cuda" and not gemlite_ok:
        emit(gemlite="skipped", reason=gemlite_unavailable_reason())
    setups = [s for s in GEMLITE_SETUPS if gemlite_ok and (s != "gemlite_max" or gemlite_max_rows)]
    kernels = ["dense", "tinygemm", "dequant", *setups]
    totals = {m: dict.fromkeys(kernels, 0.0) for m in rows}
    weights = {}

    def timed(kernel: str, name: str, m: int, fn: object) -> None:
        row: dict[str, object] = {"shape": name, "N": shapes[name][0], "K": shapes[name][1], "M": m, "kernel": kernel}
        if kernel.startswith("gemlite"):
            t = time.perf_counter()
            fn()  # type: ignore[operator]
            if dev.type == "cuda":
                torch.cuda.synchronize()
            row["first_call_ms"] = round((time.perf_counter() - t) * 1e3, 1)
        row["us"], row["timing"] = _time_us(fn, dev)
        totals[m][kernel] += row["us"]  # type: ignore[operator]
        emit(**row)  # as it is taken: a sweep cut short by its step's time limit keeps its rows

    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
        weights[name] = q = quantize_int4(w, group_size, method="minmax")
        mods = {"tinygemm": Int4Linear(q, dtype, dev, dequant_min_rows=None, gemlite=False),
                "dequant": Int4Linear(q, dtype, dev, dequant_min_rows=0, gemlite=False)}
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            timed("dense", name, m, lambda x=x, w=w: F.linear(x, w))
            for kernel, mod in mods.items():
                if mod.kernel_for(m) == kernel:  # e.g. on the CPU, Int4Linear runs tinygemm for bf16 whatever
                    timed(kernel, name, m, lambda x=x, mod=mod: mod(x))
        del w, mods
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for setup in setups:
        _setup_gemlite(setup)
        setup_rows = [m for m in rows if setup != "gemlite_max" or m in gemlite_max_rows]
        for name, (_, k) in shapes.items():
            mod = Int4Linear(weights[name], dtype, dev, gemlite=True, tinygemm_max_rows=0, dequant_min_rows=None)
            if setup == "gemlite":
                done = tune_gemlite([mod.gemlite], setup_rows, lambda g, m: True)
                emit(gemlite_setup=setup, shape=name, tune_s=done.seconds, keys=done.keys, tuned=done.tuned,
                      loaded=done.loaded, cache_written=str(done.written) if done.written else None)
            for m in setup_rows:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                timed(setup, name, m, lambda x=x, mod=mod: mod(x))
            del mod
    print(f"\nlayer totals (us, sum over {', '.join(shapes)}; g{group_size}, {dtype}, {_device_name(dev)}):")
    print(f"{'M':>6} " + " ".join(f"{k:>15}" for k in kernels) + f" {'best int4':>15} {'vs dense':>8}")
    for m in rows:
        t = totals[m]
        best = min((k for k in kernels if k != "dense" and t[k] > 0), key=t.__getitem__)
        print(f"{m:>6} " + " ".join(f"{t[k]:>15.1f}" for k in kernels) + f" {best:>15} {t['dense'] / t[best]:>7.2f}x")
    at_or_below = [m for m in rows if min(t for k, t in totals[m].items() if k != "dense" and t > 0)
                   <= totals[m]["dense"]]
    print(f"crossover: best INT4 at or below dense {dtype} at M in {at_or_below}")
    if "gemlite" not in kernels:
        return None
    tiny = [m for m in rows if totals[m]["tinygemm"] < totals[m]["gemlite"]]
    crossover = max((m for m in tiny if all(n in tiny for n in rows if n <= m)), default=0)
    from engine.quant.int4_kernel_plan import CUDA_GEMLITE_DEQUANT_MIN_ROWS

    dequant = [m for m in rows if totals[m]["dequant"] < totals[m]["gemlite"]]
    dequant_from = min((m for m in dequant if all(n in dequant for n in rows if n >= m)), default=None)
    print(f"crossover: tinygemm beats GemLite at M in {tiny}; set "
          f"engine.quant.int4_kernel_plan.CUDA_TINYGEMM_MAX_ROWS = "
          f"{crossover} (now {_tinygemm_max_rows()})")
    print(f"crossover: dequantize + GEMM beats GemLite at M in {dequant}; set engine.quant.int4_kernel_plan."
          f"CUDA_GEMLITE_DEQUANT_MIN_ROWS = {dequant_from} (now {CUDA_GEMLITE_DEQUANT_MIN_ROWS}; None = never)")
    return crossover


def _tinygemm_max_rows() -> int:
    from engine.quant.int4_kernel_plan import CUDA_TINYGEMM_MAX_ROWS

    return CUDA_TINYGEMM_MAX_ROWS


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform

    return f"cpu {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def cuda(batches: list[int], prompt_len: int, max_tokens: int, rows: list[int], sweep_only: bool = False,
         gemlite_max_rows: tuple[int, ...] = (), skip_sweep: bool = False) -> None:
    """The kernel sweep on the Llama-3.1-8B layer, then (unless sweep_only) decode output tok/s of bf16 vs INT4 g128
    (the default kernels: tinygemm up to CUDA_TINYGEMM_MAX_ROWS, GemLite above, dequantize + GEMM from
    CUDA_GEMLITE_DEQUANT_MIN_ROWS) at `batches`, KV room, and the start-up a user pays per variant (`startup`
    line: quantize, GemLite tuning/compiles at load, engine build, first generate with the CUDA-graph capture)."""
    import triton

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.ptq.quantize import quantize_model
    from engine.quant.gemlite_int4 import gemlite_unavailable_reason
    from engine.quant.int4_linear import prepare_int4_kernels

    dev = torch.device("cuda")
    gemlite_version = None
    with contextlib.suppress(Exception):
        gemlite_version = importlib.metadata.version("gemlite")
    emit(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
          gemlite=gemlite_version, date=time.strftime("%Y-%m-%d"))
    if not skip_sweep:
        kernel_sweep(dev, projection_shapes("llama-3.1-8b"), rows, gemlite_max_rows=gemlite_max_rows)
        torch.cuda.empty_cache()
    if sweep_only:
        return
    if gemlite_unavailable_reason() is None:
        _setup_gemlite("gemlite")  # the engine starts from gemlite as a fresh process has it, not the sweep's last
    tok_s: dict[tuple[str, int], float] = {}
    for variant in ("bf16", "int4-g128"):
        # A tiny KV pool first, so quantizing has room; then the real pool, sized from what the weights left.
        small = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=4096, num_kv_blocks=16,
                             max_num_seqs=max(batches))
        t0 = time.perf_counter()
        engine = LLMEngine.from_config("llama-3.1-8b", small)
        startup: dict[str, object] = {"variant": variant, "random_weights_s": round(time.perf_counter() - t0, 1)}
        if variant != "bf16":
            t = time.perf_counter()
            quantize_model(engine.runner.model, 128)
            startup["quantize_s"] = round(time.perf_counter() - t, 1)
            # What LLMEngine runs at load (engine.llm_engine), called here first to report it; with_config's call
            # below then finds every key tuned and compiled.
            max_rows = max(small.max_num_batched_tokens, small.max_num_seqs)
            done = prepare_int4_kernels(engine.runner.model, max_rows)
            if done is not None:
                startup.update(int4_prepare_s=done.seconds, gemlite_keys=done.keys, gemlite_tuned=done.tuned,
                               gemlite_configs=done.loaded)
        engine.runner.kv_caches = []
        torch.cuda.empty_cache()
        t = time.perf_counter()
        engine = engine.with_config(dataclasses.replace(small, num_kv_blocks=None))
        startup["engine_s"] = round(time.perf_counter() - t, 1)
        weights = torch.cuda.memory_allocated(dev)
        emit(variant=variant, kv_blocks=engine.num_kv_blocks, kv_tokens=engine.num_kv_blocks * engine.block_size,
              max_seqs_at_2048_tokens=engine.num_kv_blocks * engine.block_size // 2048, allocated_bytes=weights)
        for b in batches:
            prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(b)]
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            # Warm up at this batch's shapes: Triton compiles a kernel per new constexpr set (split count, chunk
            # bucket) on first use; a batch-1 warm-up left that inside the batch-8 and batch-32 timings (2026-11-25).
            # The first one also captures the CUDA graphs of every batch bucket (engine.worker.cuda_graph).
            t = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
            torch.cuda.synchronize()
            if b == batches[0]:
                startup["first_generate_s"] = round(time.perf_counter() - t, 1)
                startup["total_s"] = round(time.perf_counter() - t0, 1)
                emit(startup=startup)
            t = time.perf_counter()
            outs = engine.generate(prompts, sp)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            n = sum(len(o.output_token_ids) for o in outs)
            tok_s[variant, b] = n / dt
            emit(variant=variant, batch=b, output_tokens=n, seconds=round(dt, 3), output_tok_s=round(n / dt, 1))
        del engine
        torch.cuda.empty_cache()
    print(f"\ndecode output tok/s ({prompt_len}-token prompts, {max_tokens} tokens each; {_device_name(dev)}):")
    print(f"{'batch':>6} {'bf16':>10} {'int4-g128':>10} {'int4/bf16':>10}")
    for b in batches:
        bf, i4 = tok_s["bf16", b], tok_s["int4-g128", b]
        print(f"{b:>6} {bf:>10.1f} {i4:>10.1f} {i4 / bf:>9.2f}x")
