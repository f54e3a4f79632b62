"""The whole-engine A/B behind bench/README.md "AVX2-only CPUs": 64 prompts x 32 forced output tokens, greedy, the
default engine (fp32 on AVX2), one thread, output tokens per CPU second (robust to other processes on the machine).

Usage (run once in each tree to compare; the extra argument sets engine.layers.attention.CPU_KERNEL_MAX_PREFILL_PAIRS,
i.e. which prefill chunks go to the C++ kernel rather than SDPA, for each pass):
    python -m bench.avx2_attention_ab LABEL [PAIRS,PAIRS...]
"""

from __future__ import annotations

import sys
import time

import pyarrow.parquet as pq
import torch

import engine.layers.attention as attention
from bench.common import data_file
from engine import EngineConfig, LLMEngine, SamplingParams


def main() -> None:
    torch.set_num_threads(1)
    gsm8k = pq.read_table(data_file("gsm8k_test.parquet")).column("question").to_pylist()
    alpaca = pq.read_table(data_file("alpaca_eval.parquet")).column("instruction").to_pylist()
    engine = LLMEngine.from_model(None, EngineConfig(device="cpu"))
    engine.generate(gsm8k[:4], SamplingParams(max_tokens=4))  # warm-up: kernels built and loaded
    engine.reset_prefix_cache()
    label = sys.argv[1] if len(sys.argv) > 1 else "run"
    settings = ([int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2
                else [attention.CPU_KERNEL_MAX_PREFILL_PAIRS])
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for name, prompts in (("alpaca64", alpaca[:64]), ("gsm64", gsm8k[:64])):
        for pairs in settings:
            attention.CPU_KERNEL_MAX_PREFILL_PAIRS = pairs
            best = 0.0
            for _ in range(2):
                t = time.process_time()
                outs = engine.generate(prompts, params)
                cpu_s = time.process_time() - t
                engine.reset_prefix_cache()
                best = max(best, sum(o.num_output_tokens for o in outs) / cpu_s)
            print(label, name, f"pairs={pairs}", f"{best:.1f} output tok per CPU second", flush=True)


if __name__ == "__main__":
    main()
