"""Where a w1 decode step's time goes: torch.profiler over a window of decode steps, one table.

w1 as in bench/throughput.py: AlpacaEval prompts (chat template), every request generating --max-tokens tokens
(ignore_eos), one continuous batch. The engine runs as in that benchmark (CUDA graphs per decode bucket, Triton
attention); the first --skip-steps decode steps run unprofiled, then --profile-steps decode steps are profiled
(CUDA kernels through CUPTI, graph replays included) and the rest run unprofiled to the end (for the tok/s line).

The table (per step of the profiled window, mean; the window is decode steps only in w1, a prefill step in it is
counted and named):
- kernel time by kind: GEMM (cuBLAS/CUTLASS/nvjet, tinygemm, GemLite, the LM head), attention (our Triton paged
  kernels), sampling (argmax / sort / softmax / multinomial kernels), other (norms, RoPE, elementwise, copies);
- GPU idle: the step's wall time minus the union of its kernel intervals (host work between and inside steps:
  scheduling, input preparation, the sampled-token copy back, Python);
- graph bucket padding: the rows a captured bucket computes beyond the step's batch (bucket - n) over the bucket.
Above the table (so that the table is the run's last lines), the top 10 kernels of "other" and of "GEMM" by time (ms
and calls per step, names cut to 100 characters): what is left to fuse or tune.
On the CPU (--device cpu, a smoke run on a small model) "kernels" are the profiled ops' self CPU time (our C++
kernels are pybind calls the profiler does not see: they fall in the last row), attention and sampling told apart
by profiler ranges around the attention function and the sampler.

Usage:
    python -m bench.gpu_profile                                    # cuda, llama-3.1-8b shape, random bf16 weights
    python -m bench.gpu_profile --quantization int4                # the same with INT4 g128 projections
    python -m bench.gpu_profile --device cpu --model PATH --num-prompts 8 --max-tokens 16 --profile-steps 4
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterator

import torch

from bench.common import new_parser
from bench.throughput import alpaca_rows
from engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine.processing.parallel_sampling import engine_requests

KINDS = ("GEMM", "attention", "sampling", "other")
# CUDA kernel names by kind (first match wins): cuBLAS (sm90_xmma_gemm, nvjet, cutlass, *gemm*), tinygemm
# (tinygemm_m16n8k16...), GemLite (gemv_INT_revsplitK_kernel, gemm_splitK_INT_kernel, gemm_INT_kernel); our Triton
# attention (paged_decode_kernel, paged_prefill_kernel, their split-K reduce); sampling (argmax reductions, radix
# sort, softmax, top-k/p, multinomial, exponential for Gumbel sampling).
KERNEL_KINDS = [
    ("GEMM", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|tinygemm|int4pack|splitK|matmul|wgmma", re.I)),
    ("attention", re.compile(r"paged|attention|attn|flash", re.I)),
    ("sampling", re.compile(r"argmax|ArgMax|RadixSort|softmax|topk|top_k|multinomial|exponential|cumsum", re.I)),
]
CPU_GEMM = re.compile(r"linear|mm|matmul|int4pack|gemm", re.I)
ATTENTION_RANGE, SAMPLING_RANGE = "tm::attention", "tm::sampling"


def kernel_kind(name: str) -> str:
    """GEMM, attention, sampling or other, for a CUDA kernel name."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def _ranged(fn: Callable, label: str) -> Callable:
    def wrapped(*args: object, **kwargs: object) -> object:
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapped


@contextlib.contextmanager
def labelled_ranges(engine: LLMEngine) -> Iterator[None]:
    """Profiler ranges around the engine's attention function and sampler (for the CPU's op classification)."""
    import engine.worker.model_runner as model_runner

    runner, sample = engine.runner, model_runner.sample_rows_on_device
    attn = runner.attn_fn
    runner.attn_fn, model_runner.sample_rows_on_device = _ranged(attn, ATTENTION_RANGE), _ranged(sample, SAMPLING_RANGE)
    try:
        yield
    finally:
        runner.attn_fn, model_runner.sample_rows_on_device = attn, sample


def _cpu_kind(event: object) -> str:
    parent = event
    while parent is not None:
        if parent.name == ATTENTION_RANGE:
            return "attention"
        if parent.name == SAMPLING_RANGE:
            return "sampling"
        parent = parent.cpu_parent
    return "GEMM" if CPU_GEMM.search(event.name) else "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def kernel_times(prof: torch.profiler.profile, cuda: bool
                 ) -> tuple[dict[str, float], float, dict[tuple[str, str], list[float]]]:
    """(microseconds by kind, busy microseconds = the union of kernel intervals, and per (kind, kernel name) its
    [microseconds, calls]) over the profiled window. On the CPU the names are the profiled ops'."""
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_name: dict[tuple[str, str], list[float]] = {}
    intervals: list[tuple[float, float]] = []
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t0, t1 = e.time_range.start, e.time_range.end
            kind, us = kernel_kind(e.name), t1 - t0
            intervals.append((t0, t1))
        elif e.device_type == torch.autograd.DeviceType.CPU:
            kind, us = _cpu_kind(e), e.self_cpu_time_total  # self time: no op is counted twice
        else:
            continue
        by_kind[kind] += us
        stat = by_name.setdefault((kind, e.name), [0.0, 0])
        stat[0] += us
        stat[1] += 1
    busy = _union_us(intervals) if cuda else sum(by_kind.values())
    return by_kind, busy, by_name


def print_top_kernels(by_name: dict[tuple[str, str], list[float]], kind: str, steps: int, n: int = 10,
                      width: int = 100) -> None:
    """The n kernels of `kind` with the most time: ms and calls per step of the window, the name cut to `width`."""
    top = sorted(((us, calls, name) for (k, name), (us, calls) in by_name.items() if k == kind), reverse=True)[:n]
    print(f"\ntop {len(top)} kernels of '{kind}' by time, per step of the window:")
    print(f"{'ms':>9} {'calls':>7}  name")
    for us, calls, name in top:
        short = name if len(name) <= width else name[:width - 3] + "..."
        print(f"{us / steps / 1e3:>9.3f} {calls / steps:>7.1f}  {short}")


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default=None, help="random-weights shape (engine.loading.presets); default on cuda: "
                                                   "llama-3.1-8b")
    ap.add_argument("--model", default=None, help="model path instead of a preset (the CPU smoke run)")
    ap.add_argument("--quantization", choices=["none", "int4"], default="none",
                    help="int4: quantize the projections to INT4 g128 (engine.ptq.quantize.quantize_model)")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--sync-steps", action="store_true",
                    help="EngineConfig.async_scheduling=False: the synchronous step loop (the before of the async A/B)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--skip-steps", type=int, default=20, help="decode steps run before the profiled window")
    ap.add_argument("--profile-steps", type=int, default=30, help="decode steps profiled")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device; use --device cpu --model PATH for the smoke run")
    if args.model is None and args.preset is None and not cuda:
        raise SystemExit("--device cpu needs --model PATH (or --preset NAME)")
    dtype = "bfloat16" if cuda else "float32"
    cfg = EngineConfig(device=args.device, dtype=dtype, max_num_seqs=min(512, args.num_prompts),
                       max_model_len=4096 if (args.preset or args.model is None) else None,
                       async_scheduling=False if args.sync_steps else None)
    # INT4: a tiny KV pool first, so quantizing has room; then the real pool (as bench/int4.py does).
    first = dataclasses.replace(cfg, num_kv_blocks=16) if args.quantization == "int4" else cfg
    torch.manual_seed(0)
    if args.model is not None:
        engine = LLMEngine.from_model(args.model, first)
        tokenizer = engine.tokenizer
    else:
        from engine.loading.model_files import default_model_path
        from engine.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(default_model_path())
        engine = LLMEngine.from_config(args.preset or "llama-3.1-8b", first)
    if args.quantization == "int4":
        from engine.ptq.quantize import quantize_model

        quantize_model(engine.runner.model, 128)
        engine.runner.kv_caches = []
        if cuda:
            torch.cuda.empty_cache()
        engine = engine.with_config(cfg)
    prompts, _ = alpaca_rows(args.num_prompts)
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    engine.generate(prompt_ids[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, graph capture
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    requests = [r for item in engine.make_requests(prompt_ids, sp) if not isinstance(item, RequestOutput)
                for r in engine_requests(item)]
    engine.scheduler.add_requests(requests)

    def decode_only() -> bool:
        return all(s.num_new_tokens == 1 for s in engine.last_scheduled)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    decode_steps, profiled, window_steps, mixed, window_wall, rows, padded = 0, 0, 0, 0, 0.0, 0, 0
    t_start = time.perf_counter()
    prof: torch.profiler.profile | None = None
    with labelled_ranges(engine) if not cuda else contextlib.nullcontext():
        while engine.scheduler.has_unfinished:
            if prof is None and decode_steps == args.skip_steps:
                prof = torch.profiler.profile(activities=activities)
                prof.__enter__()
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            recording = prof is not None and profiled < args.profile_steps
            if recording:
                window_steps += 1
                window_wall += dt
            if not decode_only():  # prefill chunks (before the window in w1, where every request starts at once)
                mixed += recording
                continue
            decode_steps += 1
            if recording:
                n = len(engine.last_scheduled)
                profiled += 1
                graphs = engine.runner.graphs
                bucket = graphs.bucket(n) if graphs is not None else None
                rows += bucket or n
                padded += (bucket - n) if bucket else 0
                if profiled == args.profile_steps:
                    if cuda:
                        torch.cuda.synchronize()
                    prof.__exit__(None, None, None)
    total_s = time.perf_counter() - t_start
    out_tokens = sum(r.num_output_tokens for r in requests)
    if prof is None or profiled == 0:
        raise SystemExit(f"no decode step was profiled ({decode_steps} decode steps; lower --skip-steps)")
    if profiled < args.profile_steps:
        prof.__exit__(None, None, None)
    by_kind, busy, by_name = kernel_times(prof, cuda)
    wall_us = window_wall * 1e6
    device_name = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    for kind in ("other", "GEMM"):  # first: the step table below is the run's last lines (what a log's tail shows)
        print_top_kernels(by_name, kind, window_steps)
    print(f"\ndevice={device_name} torch={torch.__version__} model={engine.model_name} quantization="
          f"{args.quantization} requests={args.num_prompts} max_tokens={args.max_tokens} "
          f"decode steps profiled={profiled} (after {args.skip_steps})"
          + (f", with {mixed} prefill steps among them (counted in the rows below)" if mixed else ""))
    print(f"{'per step of the window':<34} {'ms':>9} {'% of wall':>10}")
    for kind in KINDS:
        print(f"{'kernels: ' + kind:<34} {by_kind[kind] / window_steps / 1e3:>9.3f} "
              f"{by_kind[kind] / wall_us:>10.1%}")
    idle = max(0.0, wall_us - busy)
    label = "GPU idle (host gap)" if cuda else "outside profiled ops (Python, host)"
    print(f"{label:<34} {idle / window_steps / 1e3:>9.3f} {idle / wall_us:>10.1%}")
    print(f"{'wall':<34} {wall_us / window_steps / 1e3:>9.3f} {1:>10.1%}")
    print(f"{'graph bucket padding (rows)':<34} {padded / profiled:>9.1f} {padded / max(rows, 1):>10.1%}")
    print(f"batch (mean rows per decode step): {(rows - padded) / profiled:.1f}; whole run: {out_tokens} output "
          f"tokens in {total_s:.2f} s ({out_tokens / total_s:.1f} tok/s, profiled steps included)")


if __name__ == "__main__":
    main()
