"""The whole job vs the engine alone, on the same rows: what the pipeline, Dask and start-up cost.

Usage:
    python -m bench.job_vs_engine --rows 256 --max-tokens 64
    python -m bench.job_vs_engine --rows 384 --start 900 --rows-per-shard 48 --max-tokens 96   # issue 45 item 8
    python -m bench.job_vs_engine ... --job-env GOMP_SPINCOUNT=10000 --job-env OMP_WAIT_POLICY=PASSIVE
    python -m bench.job_vs_engine --rows 384 --start 900 --rows-per-shard 48 --max-tokens 96 --pairs 3

Runs `tokenmill run` (a subprocess, as a user would: embedded LocalCluster, one worker, one shard, default engine
settings, chat template, greedy) on --rows GSM8K test questions from row --start (one shard, or --rows-per-shard
rows each) into a fresh OUTPUT, then, in this process, `LLMEngine.generate` on the same questions with the same
SamplingParams and the intra-op threads the job's one worker runs (jobs.plugin.default_torch_threads). Run it on a
quiet machine: another process's CPU load moves the two runs apart. Prints output tokens, seconds and output
tok/s of both, and the job's rate over the engine's twice: by the job's billed device-seconds (what the bill says)
and by its wall time from the command's start (cluster start and model load included). Each --job-env (KEY=VALUE
pairs joined by commas; "-" for none) runs one more job with those variables added to its environment (e.g. OpenMP's
spin settings), all before the one engine-alone run they are compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from bench.common import data_file, new_parser

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--start", type=int, default=0, help="first GSM8K row")
    ap.add_argument("--rows-per-shard", type=int, default=None, help="default: all rows in one shard")
    ap.add_argument("--job-env", action="append", default=None,
                    help="KEY=VALUE[,KEY=VALUE...] for one job run ('-': none); repeat for more runs")
    ap.add_argument("--pairs", type=int, default=1, help="job(s) then engine alone, this many times, alternating")
    ap.add_argument("--engine-only", metavar="PARQUET", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_only:  # the engine-alone run on that file, in its own process (main's subprocess): prints its JSON
        print(json.dumps(engine_alone(Path(args.engine_only), args.max_tokens)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="job-vs-engine-"))
    data = tmp / "in.parquet"
    pq.write_table(pq.read_table(data_file("gsm8k_test.parquet"), columns=["id", "question"]).slice(
        args.start, args.rows), data)
    envs = args.job_env or ["-"]
    ratios: dict[str, list[float]] = {env: [] for env in envs}
    for pair in range(args.pairs):
        jobs = [(env, *run_job(data, tmp / f"out{pair}-{i}", args, env)) for i, env in enumerate(envs)]
        alone = run_engine_alone(data, args.max_tokens)
        engine_rate = alone["tokens"] / alone["seconds"]
        rows = [("engine alone (LLMEngine.generate)", alone["tokens"], alone["seconds"], engine_rate)]
        for env, summary, job_wall in jobs:
            job_tokens, label = summary["output_tokens"], "" if env == "-" else f" ({env})"
            ratios[env].append(job_tokens / summary["device_s"] / engine_rate)
            rows += [(f"tokenmill run{label}, billed device-seconds", job_tokens, summary["device_s"],
                      job_tokens / summary["device_s"]),
                     (f"tokenmill run{label}, wall from the command's start", job_tokens, job_wall,
                      job_tokens / job_wall)]
        print(f"pair {pair + 1}: {args.rows} GSM8K rows, max_tokens {args.max_tokens}, dtype {alone['dtype']}, "
              f"threads {alone['threads']}, load average {os.getloadavg()[0]:.1f}")
        print("| measure | output tokens | seconds | output tok/s | vs engine alone |")
        print("|---|---|---|---|---|")
        for name, tokens, seconds, rate in rows:
            print(f"| {name} | {tokens:,} | {seconds:.2f} | {rate:.1f} | {rate / engine_rate:.0%} |")
    if args.pairs > 1:
        print("| job env | job / engine by billed device-seconds, per pair | median |")
        print("|---|---|---|")
        for env, rs in ratios.items():
            print(f"| {env} | {', '.join(f'{r:.3f}' for r in rs)} | {statistics.median(rs):.3f} |")


def engine_alone(data: Path, max_tokens: int) -> dict:
    """LLMEngine.generate on `data`'s questions after a warm-up, with the job's one-worker thread count: its output
    tokens, seconds, dtype and threads."""
    import torch

    from engine import LLMEngine, SamplingParams
    from jobs.plugin import default_torch_threads

    torch.set_num_threads(default_torch_threads(1))  # as the job's one worker runs its engine
    questions = pq.read_table(data, columns=["question"]).column("question").to_pylist()
    engine = LLMEngine.from_model(None)
    engine.generate(questions[:2], SamplingParams(max_tokens=4))  # warm-up (kernel build, first-call costs)
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = engine.generate(questions, SamplingParams(max_tokens=max_tokens))
    seconds = time.perf_counter() - t0
    return {"tokens": sum(o.num_output_tokens for o in outs), "seconds": seconds, "dtype": str(engine.dtype),
            "threads": torch.get_num_threads()}


def run_engine_alone(data: Path, max_tokens: int) -> dict:
    """engine_alone in a fresh process (as each job is one): this machine's environment, libgomp's default wait
    policy unless the caller's environment sets one. Exits when it fails."""
    cmd = [sys.executable, "-m", "bench.job_vs_engine", "--engine-only", str(data),
           "--max-tokens", str(max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode != 0:
        sys.exit(f"the engine-alone run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_job(data: Path, out: Path, args: object, env: str) -> tuple[dict, float]:
    """`tokenmill run` on `data` into `out` with the extra environment `env` ("-" or KEY=VALUE,...): (its JSON
    summary, its wall seconds from the command's start). Exits when the job fails."""
    cmd = [sys.executable, "-m", "jobs.cli", "run", str(data), str(out), "--prompt-column", "question",
           "--rows-per-shard", str(args.rows_per_shard or args.rows), "--max-tokens", str(args.max_tokens),
           "--workers", "1", "--json"]
    extra = {} if env == "-" else dict(pair.split("=", 1) for pair in env.split(","))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, env={**os.environ, **extra})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"tokenmill run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


if __name__ == "__main__":
    main()
