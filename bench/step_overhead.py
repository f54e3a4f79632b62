"""Host microseconds per row per step of the engine's step loop, with a model whose compute is negligible.

The engine runs a 1-layer random-weight model (hidden 32, fp32, one thread) over `rows` requests of 32-token random
prompts and 64 output tokens each (ignore_eos), with max_num_seqs = rows, so every decode step runs all rows. The
step's parts are timed by wrapping the engine's methods with perf_counter:

- scheduler: `Scheduler.schedule` (plan the step, allocate KV slots)
- inputs: `ModelRunner._prepare` (input ids, positions, slot mapping, block tables, attention metadata)
- sampling: `engine.sample.sampler.sample_rows` as the runner calls it (argmax, the sampled rows' parameters, the host
  sync)
- output: `Scheduler.update_from_output` (counters, appended tokens, stop checks, incremental detokenization)
- model: the forward pass and the LM head (the model's `forward`, `compute_logits`), excluded from "host"
- host: the whole `LLMEngine.step` minus the model; per row per step = host / (sum over steps of rows in the step).

Times are the CPU time of the engine's thread (time.thread_time; torch runs one thread), so a loaded machine
inflates them less than wall time would; compare trees in runs made close together.

Usage: python -m bench.step_overhead [--rows 64 256 512] [--vocab 512] [--stop] [--profile]
(--stop gives every row a stop string that never matches, so each row is detokenized every step; it needs the
default model's tokenizer, whose ids cover any vocabulary up to 49,152.) Run with PYTHONPATH at the tree to measure.

python -m bench.step_overhead --ab TREE_A TREE_B: the real model (the default SmolLM2-135M GGUF, CPU, dtype auto)
on 64 AlpacaEval prompts x 64 forced tokens (ignore_eos), greedy, one thread, in a fresh process per tree
(PYTHONPATH=TREE), alternating A, B, A, B: output tok/s per CPU-second of the process (robust to other load) and
per wall second, best of the two runs of each, and whether both trees produced the same tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import engine.worker.model_runner as model_runner_module
from engine.config import EngineConfig, ModelConfig
from engine.core.scheduler import Scheduler
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner

PROMPT_LEN = 32
OUTPUT_LEN = 64


def tiny_config(vocab: int) -> ModelConfig:
    """The 1-layer model of the benchmark: hidden 32, 2 heads of 16, one KV head."""
    return ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def clock_cost() -> float:
    """Seconds one time.thread_time() call takes here (a system call: microseconds in some sandboxes)."""
    t0 = time.perf_counter()
    for _ in range(2000):
        time.thread_time()
    return (time.perf_counter() - t0) / 2000


class Timers:
    """Seconds spent per named part, summed over calls, less the cost of the clock reads themselves (a timed span
    holds about one read's cost; an enclosing span also holds both reads of each span inside it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.cost = clock_cost()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.thread_time() - t0 - self.cost
                self.calls[name] += 1
        return timed


def run(rows: int, vocab: int, stop: bool, profile: bool, tokenizer: Any) -> dict[str, float]:
    """One generate of `rows` requests; returns microseconds per row per step of each part (and the step count)."""
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=rows, max_num_batched_tokens=2048,
                          num_kv_blocks=rows * (PROMPT_LEN + OUTPUT_LEN) // 16 + rows, enable_prefix_caching=True)
    engine = LLMEngine.from_config(tiny_config(vocab), config, tokenizer=tokenizer)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(rows)]
    params = SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True, stop=("\x00never\x00",) if stop else ())
    timers = Timers()
    row_steps = 0
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, name: str) -> None:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, timers.wrap(name, getattr(owner, attr)))

    patch(Scheduler, "schedule", "scheduler")
    patch(ModelRunner, "_prepare", "inputs")
    # The sampler as the runner calls it (`sample` in trees before the sampling parameters moved to the batch,
    # `sample_rows` before the asynchronous steps; since, the host sync, `tolist`, is the runner's, counted in host).
    sampler = next(n for n in ("sample_rows_on_device", "sample_rows", "sample") if hasattr(model_runner_module, n))
    patch(model_runner_module, sampler, "sampling")
    patch(Scheduler, "update_from_output", "output")
    model_class = type(engine.runner.model)  # the registry's class of this model (engine.model.registry)
    patch(model_class, "forward", "model")
    patch(model_class, "compute_logits", "model")
    step = engine.step

    per_step: list[tuple[int, dict[str, float]]] = []  # (rows, seconds of each part) of every step

    def counted_step() -> Any:
        before, calls = dict(timers.seconds), sum(timers.calls.values())
        rows0 = row_steps
        t0 = time.thread_time()
        finished = step()
        timers.seconds["step"] += time.thread_time() - t0 - timers.cost
        inner_calls = sum(timers.calls.values()) - calls
        parts = {k: v - before.get(k, 0.0) for k, v in timers.seconds.items()}
        parts["host"] = parts["step"] - parts.get("model", 0.0) - 2 * inner_calls * timers.cost
        per_step.append((row_steps - rows0, parts))
        return finished

    # Count the rows of each step from the plan the scheduler returns.
    schedule = Scheduler.schedule

    def counting_schedule(self: Scheduler) -> Any:
        nonlocal row_steps
        plan = schedule(self)
        row_steps += len(plan.scheduled)
        return plan

    Scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    engine.step = counted_step  # type: ignore[method-assign]
    prof = cProfile.Profile() if profile else None
    try:
        if prof:
            prof.enable()
        outs = engine.generate(prompts, params)
        if prof:
            prof.disable()
    finally:
        Scheduler.schedule = schedule  # type: ignore[method-assign]
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
    if any(o.num_output_tokens != OUTPUT_LEN for o in outs):
        raise RuntimeError("a row stopped early; the benchmark needs every row to run OUTPUT_LEN tokens")
    s = timers.seconds
    inner = sum(n for k, n in timers.calls.items() if k != "step")
    us = {k: v / row_steps * 1e6 for k, v in s.items()}
    us["host"] = (s["step"] - s["model"] - 2 * inner * timers.cost) / row_steps * 1e6
    us["steps"] = engine.num_steps
    # The median over the decode steps that run every row (the steady state), per row: robust to the slices of
    # time other processes take from a loaded machine, which the sums above absorb.
    full = [parts for n, parts in per_step if n == rows and parts.get("model", 0.0) > 0][1:]  # [0]: a prefill
    for k in ("host", "scheduler", "inputs", "sampling", "output"):
        us[f"median_{k}"] = statistics.median(p.get(k, 0.0) for p in full) / rows * 1e6 if full else float("nan")
    # The least disturbed full step: the floor of the host work, for A/Bs on a machine others load.
    us["min_host"] = min(p["host"] for p in full) / rows * 1e6 if full else float("nan")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return us


def real_once() -> None:
    """One w1 generation of the real model in this process; prints a JSON line (cpu_s, wall_s, tokens, digest)."""
    import hashlib
    import json
    import os

    import pyarrow.parquet as pq

    from engine.config import EngineConfig as Config

    # NOTE: not bench.common.data_file: this runs in other checkouts too (ab), older than bench/common.py
    data = os.path.join(os.environ.get("TOKENMILL_DATA_DIR")
                        or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data"),
                        "alpaca_eval.parquet")
    prompts = pq.read_table(data, columns=["instruction"]).column(0).to_pylist()[:64]
    torch.set_num_threads(1)  # CPU seconds of one thread: OpenMP workers spin while they wait, on a loaded machine
    llm = LLMEngine.from_model(None, Config(device="cpu"))
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    llm.reset_prefix_cache()
    c0, w0 = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    tokens = sum(o.num_output_tokens for o in outs)
    digest = hashlib.sha256(json.dumps([o.output_token_ids for o in outs]).encode()).hexdigest()[:16]
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "tokens": tokens, "digest": digest}))


def ab(trees: list[str]) -> None:
    """Alternate fresh processes of `real_once` over the trees, twice; print the best of each."""
    import json
    import os
    import subprocess
    import sys

    best: dict[str, dict[str, float]] = {}
    digests: dict[str, set[str]] = {t: set() for t in trees}
    for _ in range(2):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--real-once"], env=env, cwd=tree,
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            digests[tree].add(r["digest"])
            cpu_rate, wall_rate = r["tokens"] / r["cpu_s"], r["tokens"] / r["wall_s"]
            b = best.setdefault(tree, {"cpu": 0.0, "wall": 0.0})
            b["cpu"], b["wall"] = max(b["cpu"], cpu_rate), max(b["wall"], wall_rate)
            print(f"{tree}: {cpu_rate:.1f} tok/CPU-s, {wall_rate:.1f} tok/s wall, tokens {r['digest']}", flush=True)
    a, b = trees[0], trees[-1]
    print(f"best: {a} {best[a]['cpu']:.1f} tok/CPU-s ({best[a]['wall']:.1f} wall); {b} {best[b]['cpu']:.1f} "
          f"({best[b]['wall']:.1f} wall); ratio {best[b]['cpu'] / best[a]['cpu']:.3f} (CPU), "
          f"{best[b]['wall'] / best[a]['wall']:.3f} (wall); same tokens: {digests[a] == digests[b]}")


def main() -> None:
    if "--real-once" in sys.argv:
        return real_once()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ab", nargs=2, metavar=("TREE_A", "TREE_B"), help="real-model A/B of two trees (module doc)")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--stop", action="store_true", help="a never-matching stop string on every row")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest run, top 25 by own time")
    ap.add_argument("--repeat", type=int, default=2, help="runs per setting; the best is reported")
    args = ap.parse_args()
    if args.ab:
        return ab(args.ab)
    torch.set_num_threads(1)
    tokenizer = None
    if args.stop:
        from engine.loading.model_files import resolve_model_path
        from engine.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf(resolve_model_path(None))
    run(16, args.vocab, args.stop, False, tokenizer)  # warm-up: imports, kernels, allocator
    cols = ("host", "scheduler", "inputs", "sampling", "output", "model", "median_host", "median_scheduler",
            "median_inputs", "median_sampling", "median_output", "min_host")
    print(f"vocab {args.vocab}, stop strings {'on' if args.stop else 'off'}, us per row per step (best of "
          f"{args.repeat}; all steps summed, then the median and the minimum of the decode steps that run every row)")
    print("| rows | steps | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for rows in args.rows:
        best = min((run(rows, args.vocab, args.stop, args.profile and rows == max(args.rows) and i == 0, tokenizer)
                    for i in range(args.repeat)), key=lambda u: u["median_host"])
        print(f"| {rows} | {best['steps']:.0f} | " + " | ".join(f"{best[c]:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
