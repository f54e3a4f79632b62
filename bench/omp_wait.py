"""OpenMP's wait policy and a shared machine: the engine at the default thread count, beside `--noise` busy
processes, under each OMP_WAIT_POLICY (the figures of bench/README.md "OpenMP wait policy").

libgomp reads OMP_WAIT_POLICY (and GOMP_SPINCOUNT) once, when torch loads it; a job's processes get PASSIVE unless
the variable is set (jobs/process_env.py), a library user of LLMEngine gets libgomp's default. Here each setting runs
LLMEngine.generate in a fresh process whose environment names it ("default" = libgomp's own: threads spin up to
300,000 rounds at each barrier). A busy process
is `python -c 'while True: pass'`, started before and stopped after each run, so the machine is shared the same way
for every setting.

Usage:
    python -m bench.omp_wait                                   # 2 busy processes, default vs PASSIVE vs 1 thread
    python -m bench.omp_wait --noise 0 --prompts 64            # a quiet machine: what PASSIVE costs there
    python -m bench.omp_wait --settings default,PASSIVE,spin=1000
    python -m bench.omp_wait --noise 0 --settings default,PASSIVE,PASSIVE+idle   # + one SCHED_IDLE spinner per CPU

Each run: the default model (SmolLM2-135M GGUF), the first --prompts AlpacaEval instructions in the chat template,
--max-tokens forced tokens, greedy, one `generate`; reports wall seconds, CPU seconds of the process and output
tokens per wall second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import ROOT, new_parser

RUN = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import pyarrow.parquet as pq
import torch
from engine import EngineConfig, LLMEngine, SamplingParams
threads = {threads}
if threads:
    torch.set_num_threads(threads)
prompts = pq.read_table({data!r}).column("instruction").to_pylist()[:{n}]
eng = LLMEngine.from_model(None, EngineConfig(device="cpu"))
msgs = [[{{"role": "user", "content": p}}] for p in prompts]
eng.generate(msgs[:2], SamplingParams(max_tokens=4, ignore_eos=True))
eng.reset_prefix_cache()
cpu, wall = time.process_time(), time.perf_counter()
outs = eng.generate(msgs, SamplingParams(max_tokens={max_tokens}, ignore_eos=True))
print(json.dumps({{"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "tokens": sum(o.num_output_tokens for o in outs), "threads": torch.get_num_threads()}}))
"""


def environment(setting: str) -> tuple[dict[str, str], int]:
    """The process environment and torch thread count (0 = torch's default) of one setting."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if setting == "default":
        return env, 0
    if setting == "1-thread":
        return env, 1
    if setting.endswith("+idle"):  # a SCHED_IDLE spinner per CPU beside it (run): the CPUs never go idle
        setting = setting.removesuffix("+idle")
    if setting.startswith("spin="):
        env["GOMP_SPINCOUNT"] = setting.removeprefix("spin=")
        return env, 0
    env["OMP_WAIT_POLICY"] = setting
    return env, 0


def run(setting: str, args: argparse.Namespace) -> dict:
    """One generate in a fresh process beside args.noise busy processes."""
    env, threads = environment(setting)
    data = ROOT.parent / "shared" / "data" / "alpaca_eval.parquet"
    code = RUN.format(root=str(ROOT), threads=threads, data=str(data), n=args.prompts, max_tokens=args.max_tokens)
    noise = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.noise)]
    if setting.endswith("+idle"):
        idle = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"
        noise += [subprocess.Popen([sys.executable, "-c", idle]) for _ in range(os.cpu_count() or 1)]
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                              timeout=args.timeout)
    finally:
        for p in noise:
            p.kill()
            p.wait()
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--settings", default="default,PASSIVE,1-thread",
                    help="comma-separated: default, PASSIVE, ACTIVE, spin=N (GOMP_SPINCOUNT), 1-thread")
    ap.add_argument("--noise", type=int, default=2, help="busy processes beside the engine")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the settings (interleaved)")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs, {args.noise} busy processes, {args.prompts} prompts x {args.max_tokens} tokens")
    print("| setting | threads | wall s | CPU s | output tok/s (wall) |")
    print("|---|---|---|---|---|")
    for _ in range(args.repeat):
        for setting in args.settings.split(","):
            r = run(setting, args)
            print(f"| {setting} | {r['threads']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} "
                  f"| {r['tokens'] / r['wall_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
