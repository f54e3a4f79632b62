"""The whole job vs the engine alone, on the same rows: what the pipeline, Dask and start-up cost.

Usage:
    python -m bench.job_vs_engine --rows 256 --max-tokens 64
    python -m bench.job_vs_engine --rows 384 --start 900 --rows-per-shard 48 --max-tokens 96   # issue 45 item 8

Runs `tokenmill run` (a subprocess, as a user would: embedded LocalCluster, one worker, one shard, default engine
settings, chat template, greedy) on --rows GSM8K test questions from row --start (one shard, or --rows-per-shard
rows each) into a fresh OUTPUT, then, in this process, `LLMEngine.generate` on the same questions with the same
SamplingParams and the intra-op threads the job's one worker runs (jobs.plugin.default_torch_threads). Run it on a
quiet machine: another process's CPU load moves the two runs apart. Prints output tokens, seconds and output
tok/s of both, and the job's rate over the engine's twice: by the job's billed device-seconds (what the bill says)
and by its wall time from the command's start (cluster start and model load included).
"""

from __future__ import annotations

import json
import os
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
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="job-vs-engine-"))
    data = tmp / "in.parquet"
    pq.write_table(pq.read_table(data_file("gsm8k_test.parquet"), columns=["id", "question"]).slice(
        args.start, args.rows), data)

    out = tmp / "out"
    cmd = [sys.executable, "-m", "jobs.cli", "run", str(data), str(out), "--prompt-column", "question",
           "--rows-per-shard", str(args.rows_per_shard or args.rows), "--max-tokens", str(args.max_tokens),
           "--workers", "1", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    job_wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"tokenmill run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])

    import torch

    from engine import LLMEngine, SamplingParams
    from jobs.plugin import default_torch_threads

    torch.set_num_threads(default_torch_threads(1))  # as the job's one worker runs its engine
    questions = pq.read_table(data, columns=["question"]).column("question").to_pylist()
    engine = LLMEngine.from_model(None)
    engine.generate(questions[:2], SamplingParams(max_tokens=4))  # warm-up (kernel build, first-call costs)
    engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = engine.generate(questions, SamplingParams(max_tokens=args.max_tokens))
    engine_s = time.perf_counter() - t0
    engine_tokens = sum(o.num_output_tokens for o in outs)

    job_tokens = summary["output_tokens"]
    engine_rate = engine_tokens / engine_s
    rows = [("engine alone (LLMEngine.generate)", engine_tokens, engine_s, engine_rate),
            ("tokenmill run, billed device-seconds", job_tokens, summary["device_s"], job_tokens / summary["device_s"]),
            ("tokenmill run, wall from the command's start", job_tokens, job_wall, job_tokens / job_wall)]
    print(f"{args.rows} GSM8K rows, max_tokens {args.max_tokens}, dtype {engine.dtype}, "
          f"threads {__import__('torch').get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    print("| measure | output tokens | seconds | output tok/s | vs engine alone |")
    print("|---|---|---|---|---|")
    for name, tokens, seconds, rate in rows:
        print(f"| {name} | {tokens:,} | {seconds:.2f} | {rate:.1f} | {rate / engine_rate:.0%} |")


if __name__ == "__main__":
    main()
