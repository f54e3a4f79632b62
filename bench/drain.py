"""Does the batch drain between shards? The whole job at several --rows-per-shard against the engine alone.

Usage:
    python -m bench.drain --rows 1024 --max-tokens 256 --max-num-seqs 256 --rows-per-shard 64,256,1024

Runs `LLMEngine.generate` on the first --rows GSM8K test questions in one call (greedy, chat template, EOS
honoured: natural output lengths up to --max-tokens), then, per --rows-per-shard, the job `tokenmill run` runs
(jobs.runner.run_job) on the same rows into a fresh OUTPUT, on a LocalCluster of one worker started here with the
job's settings (jobs.cluster.CLUSTER_CONFIG, shard slots from jobs.plugin.shard_slots, --threads torch threads), so
that the worker's engine step statistics (engine.core.step_stats) can be read back before the cluster closes.

Prints, per run: output tokens, seconds (the engine's generate call; the job's billed device-seconds, every shard's
`device_s_billed`), output tok/s per (device-)second, CPU-seconds per output token (the engine's: this process's CPU
time over the generate call; the job's: the worker process's CPU time from the end of its model load to the job's
end: every shard's reading, engine steps, merging, commits and Dask's own threads; on a loaded machine the fair
comparison, with --threads 1 so that no OpenMP thread waits for a descheduled sibling), the batch-size histogram
over steps (deciles of max_num_seqs),
and the structural target of issue 28: among the steps during which some rows were not yet admitted, the share
that ran fewer than max_num_seqs / 2 requests (target < 2%). The last line is a JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import dask
import pyarrow.parquet as pq

from bench.common import data_file, new_parser

ROOT = Path(__file__).resolve().parents[1]


def step_figures(batch: list[int], admitted: list[int], rows: int, max_num_seqs: int) -> dict[str, Any]:
    """Histogram (deciles of max_num_seqs) and the share of steps below max_num_seqs / 2 among the steps after
    which some of `rows` requests were not yet admitted, from a step trace (engine.core.step_stats).

    Of those low steps, `low_steps_idle_admission` counts the ones in which no request joined the batch: a drain
    (the batch shrinking while rows are still to come). A low step that admitted rows is the batch filling up
    under the step's token budget (max_num_batched_tokens of prefill: the start of every run, the engine's own
    included), a step the prompts' tokens keep full."""
    deciles = [0] * 10
    for b in batch:
        deciles[min(9, (b * 10 - 1) // max_num_seqs if b else 0)] += 1
    joined = [a - p for a, p in zip(admitted, [0, *admitted[:-1]], strict=True)]
    pending = [(b, j) for b, a, j in zip(batch, admitted, joined, strict=True) if a < rows]
    low = sum(b < max_num_seqs / 2 for b, _ in pending)
    idle = sum(b < max_num_seqs / 2 and j == 0 for b, j in pending)
    return {"steps": len(batch), "histogram_deciles": deciles, "steps_rows_pending": len(pending),
            "low_steps_rows_pending": low, "low_share_rows_pending": low / len(pending) if pending else 0.0,
            "low_steps_idle_admission": idle, "mean_batch": sum(batch) / len(batch) if batch else 0.0}


def _worker_trace(dask_worker: Any) -> tuple[list[int], list[int], float]:
    """The worker engine's step trace, and the worker process's CPU seconds since its model load ended."""
    from jobs.plugin import PLUGIN_PREFIX

    for name, plugin in dask_worker.plugins.items():
        if name.startswith(PLUGIN_PREFIX):
            stats = plugin.get().step_stats
            return list(stats.trace_batch), list(stats.trace_admitted), time.process_time() - plugin.loaded_cpu_s
    raise RuntimeError("no engine plugin on this worker")


def run_engine(questions: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_model(args.model, EngineConfig(device="cpu", max_num_seqs=args.max_num_seqs,
                                                             quantization=args.quantization))
    engine.generate(questions[:2], SamplingParams(max_tokens=4))  # warm-up (kernel build, first-call costs)
    engine.reset_prefix_cache()
    engine.step_stats.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(questions, SamplingParams(max_tokens=args.max_tokens))
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(o.num_output_tokens for o in outs)
    stats = engine.step_stats
    return {"run": "engine.generate", "output_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "cpu_s": cpu_s, "cpu_ms_per_token": 1e3 * cpu_s / tokens,
            **step_figures(list(stats.trace_batch), list(stats.trace_admitted), len(questions), args.max_num_seqs)}


def run_job(input_url: str, rows: int, rows_per_shard: int, args: argparse.Namespace) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    from engine import EngineConfig
    from jobs.cluster import CLUSTER_CONFIG
    from jobs.plugin import shard_slots
    from jobs.runner import run_job as job
    from pipeline.config import RunConfig

    engine_config = EngineConfig(device="cpu", max_num_seqs=args.max_num_seqs, quantization=args.quantization)
    slots = args.shard_slots or shard_slots(args.max_num_seqs, rows_per_shard)
    cfg = RunConfig(prompt_column="question", max_tokens=args.max_tokens, rows_per_shard=rows_per_shard,
                    limit=rows)
    out = tempfile.mkdtemp(prefix=f"drain-{rows_per_shard}-")
    # The nanny's OMP_NUM_THREADS=1 would leave the engine's step thread one core; give it --threads, as
    # `tokenmill run`'s own LocalCluster does (jobs.plugin.default_torch_threads).
    settings = {**CLUSTER_CONFIG, "distributed.nanny.pre-spawn-environ.OMP_NUM_THREADS": str(args.threads)}
    with dask.config.set(settings), LocalCluster(n_workers=1, threads_per_worker=slots, processes=True,
                                                 dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        summary = job(input_url, out, cfg, model=args.model, engine_config=engine_config,
                      scheduler_address=cluster.scheduler_address, shard_slots=slots)
        (batch, admitted, cpu_s), = client.run(_worker_trace).values()
    if summary.failed or summary.shards_ok != summary.shards:
        raise SystemExit(f"the job at --rows-per-shard {rows_per_shard} failed: {summary.failed}")
    tokens = summary.output_tokens
    return {"run": f"tokenmill run, --rows-per-shard {rows_per_shard} ({slots} shard slots)",
            "output_tokens": tokens, "seconds": summary.device_s, "tok_per_s": tokens / summary.device_s,
            "wall_s": summary.wall_s, "cpu_s": cpu_s, "cpu_ms_per_token": 1e3 * cpu_s / tokens,
            **step_figures(batch, admitted, rows, args.max_num_seqs)}


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--rows-per-shard", default="64,256,1024", help="comma-separated")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    ap.add_argument("--model", default=None, help="default: the default SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--shard-slots", type=int, default=None,
                    help="shards per worker at once (default: jobs.plugin.shard_slots); 1 = one shard at a time, "
                         "each drained before the next starts, as before the engine loop")
    ap.add_argument("--quantization", default="none", choices=["none", "int8"],
                    help="the engine's weights in both the engine run and the job (int8: shorter runs on a CPU)")
    ap.add_argument("--no-engine", action="store_true", help="skip the LLMEngine.generate run")
    args = ap.parse_args()

    data = data_file("gsm8k_test.parquet")
    table = pq.read_table(data, columns=["id", "question"]).slice(0, args.rows)
    folder = Path(tempfile.mkdtemp(prefix="drain-in-"))
    pq.write_table(table, folder / "in.parquet")
    questions = table.column("question").to_pylist()

    results = [] if args.no_engine else [run_engine(questions, args)]
    if results:
        print(json.dumps(results[-1]), flush=True)  # each run as it ends: a long bench leaves what it measured
    for rps in (int(x) for x in args.rows_per_shard.split(",")):
        results.append(run_job(str(folder), len(questions), rps, args))
        print(json.dumps(results[-1]), flush=True)
    base = results[0]["tok_per_s"]  # the engine's, or the first job's with --no-engine
    base_cpu = results[0]["cpu_ms_per_token"]
    print(f"{args.rows} GSM8K rows, max_tokens {args.max_tokens}, max_num_seqs {args.max_num_seqs}, "
          f"{args.threads} threads, quantization {args.quantization}")
    print("| run | output tokens | (device-)s | output tok/s | vs engine | CPU-ms per token | engine/run by CPU | "
          "steps | mean batch | steps < max_num_seqs/2 while rows wait | batch deciles of max_num_seqs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['output_tokens']} | {r['seconds']:.1f} | {r['tok_per_s']:.1f} | "
              f"{r['tok_per_s'] / base:.2f}x | {r['cpu_ms_per_token']:.1f} | {base_cpu / r['cpu_ms_per_token']:.3f} | "
              f"{r['steps']} | {r['mean_batch']:.1f} | "
              f"{r['low_steps_rows_pending']}/{r['steps_rows_pending']} ({100 * r['low_share_rows_pending']:.1f}%; "
              f"{r['low_steps_idle_admission']} admitting no row) | "
              f"{r['histogram_deciles']} |")
    print(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
