"""User and system CPU seconds and page faults of one engine run: the microbenchmark that showed the CPU KV pool's
page-fault cost (bench/README.md, "KV pool pages").

Usage (A/B of two trees, alternated, pinned to one core):
    for i in 1 2; do for t in TREE_A TREE_B; do (cd $t && PYTHONPATH=$t taskset -c 0 \\
        python -m bench.cpu_time_split --rows 128); done; done

Runs the default SmolLM2-135M GGUF (fp32 auto dtype on an AVX2 CPU) on the first --rows GSM8K questions, --max-tokens
forced tokens each, one torch thread, after a 2-prompt warm-up, and prints one JSON line: user and system CPU
seconds of the generate call (getrusage), minor page faults, output tokens per CPU-second, wall seconds.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from bench.common import data_file, new_parser

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    from engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(1)
    questions = pq.read_table(data_file("gsm8k_test.parquet"), columns=["question"]).column("question").to_pylist()
    engine = LLMEngine.from_model(None, EngineConfig(device="cpu", max_num_seqs=256))
    engine.generate(questions[:2], SamplingParams(max_tokens=4))
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    outs = engine.generate(questions[:args.rows], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    user, sys_s = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    tokens = sum(o.num_output_tokens for o in outs)
    print(json.dumps({"tree": str(ROOT), "user_s": round(user, 2), "sys_s": round(sys_s, 2),
                      "minor_faults": r1.ru_minflt - r0.ru_minflt, "tok_per_cpu_s": round(tokens / (user + sys_s), 1),
                      "wall_s": round(wall, 1)}))


if __name__ == "__main__":
    main()
