"""Is a token as cheap at 256 concurrent rows as at 64? The same GSM8K prompts through one engine, all --rows at once
against consecutive chunks of --chunk rows, for the KV pool's auto size (half the free memory) and a fixed one
(--fixed-kv-gib, the old default 1 GiB), in one process (the weights shared: LLMEngine.with_config), greedy, chat
template, --max-tokens forced output tokens. Prints output tokens per CPU-second (this process's CPU time over the
generate calls: on a shared machine steadier than wall time; use --threads 1 there), the scheduler's preemptions
(each one recomputes a row's prefix) and the pool's size in blocks.

    python -m bench.batch_scaling --rows 256 --chunk 64 --threads 1
"""

from __future__ import annotations

import time

import pyarrow.parquet as pq
import torch

from bench.common import data_file, new_parser
from engine import EngineConfig, LLMEngine, SamplingParams


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--fixed-kv-gib", type=float, default=1.0, help="the fixed pool to compare with; 0 = none")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    questions = pq.read_table(data_file("gsm8k_test.parquet"), columns=["question"]).column("question").to_pylist()
    prompts = [[{"role": "user", "content": q}] for q in questions[:args.rows]]
    base = LLMEngine.from_model(None, EngineConfig(device="cpu", max_num_seqs=args.rows))
    engines = {"auto": base}
    if args.fixed_kv_gib > 0:
        engines[f"{args.fixed_kv_gib:g} GiB"] = base.with_config(EngineConfig(
            device="cpu", max_num_seqs=args.rows, kv_cache_memory_bytes=int(args.fixed_kv_gib * (1 << 30))))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    base.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: kernel build, first calls
    print(f"{args.rows} GSM8K rows x {args.max_tokens} tokens, torch threads {torch.get_num_threads()}")
    print("| KV pool | blocks | rows at once | output tokens | CPU s | output tok per CPU s | preemptions |")
    print("|---|---|---|---|---|---|---|")
    for _ in range(args.reps):
        for name, engine in engines.items():
            for at_once in (args.rows, args.chunk):
                engine.reset_prefix_cache()
                before = engine.scheduler.num_preemptions
                c0, tokens = time.process_time(), 0
                for i in range(0, args.rows, at_once):
                    tokens += sum(o.num_output_tokens for o in engine.generate(prompts[i:i + at_once], params))
                cpu_s = time.process_time() - c0
                print(f"| {name} | {engine.num_kv_blocks} | {at_once} | {tokens} | {cpu_s:.1f} | {tokens / cpu_s:.1f} "
                      f"| {engine.scheduler.num_preemptions - before} |", flush=True)


if __name__ == "__main__":
    main()
