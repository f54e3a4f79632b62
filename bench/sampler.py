"""Sampler microbenchmark (CPU): one step's sampling of [R, V] bf16 logits, the C++ kernel vs the torch ops.

Usage:
    python -m bench.sampler                       # R = 64 rows, V = 49,152 (SmolLM2's vocabulary), 2 threads
    python -m bench.sampler --rows 256 --logits model   # logits of the real model on AlpacaEval prompts
    python -m bench.sampler --generate            # w1 generations per setting, 1 thread, by CPU seconds

What it showed (bench/README.md, "fourth session"): the sampler before (an exponential race over the whole
vocabulary, with a sort of every row for top-p) took 77 ms per 64-row step at temperature 0.7 and 173 ms with top_p
0.9 on a quiet machine (about the time of a whole decode step, which was then spent twice); the kernel takes 3.5 and
5 ms. Run it in the previous commit's tree for the "before" column. `--index-select` times torch's CPU index_select of
whole logit rows against x[rows]: on a loaded machine it was 500 ms vs 7 ms (its OpenMP threads wait on each other),
so the sampler selects rows with x[rows].
"""

from __future__ import annotations

import argparse
import time

import torch

import engine.sample.sampler as sampler
from engine.kernels.cpu_kernels import cpu_ops
from engine.sampling_params import SamplingParams

KINDS = {"greedy": SamplingParams(), "temperature 0.7": SamplingParams(temperature=0.7),
         "t 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
         "t 1.0, top_p 0.95": SamplingParams(temperature=1.0, top_p=0.95),
         "t 0.7, top_k 50": SamplingParams(temperature=0.7, top_k=50),
         "t 0.7, top_p 0.9, seeded": SamplingParams(temperature=0.7, top_p=0.9, seed=1)}


def model_logits(rows: int) -> torch.Tensor:
    """bf16 [rows, V] next-token logits of the default model at the end of AlpacaEval prompts (chat template)."""
    from throughput import alpaca_rows

    import engine.worker.model_runner as model_runner
    from engine import LLMEngine

    llm = LLMEngine.from_model(None)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in alpaca_rows(rows)[0]]
    captured: list[torch.Tensor] = []
    real = model_runner.sample_rows_on_device

    def keep(logits: torch.Tensor, *args: object) -> torch.Tensor:
        captured.append(logits.clone())
        return real(logits, *args)

    model_runner.sample_rows_on_device = keep
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1))
    finally:
        model_runner.sample_rows_on_device = real
    return torch.cat(captured)[:rows].to(torch.bfloat16)


def generate(threads: int) -> None:
    """w1 (64 AlpacaEval prompts x 64 tokens, EOS ignored) greedy and at each sampling setting, timed in CPU seconds
    of this process (robust to other processes on a shared machine, unlike wall time)."""
    from throughput import alpaca_rows

    from engine import LLMEngine

    torch.set_num_threads(threads)
    llm = LLMEngine.from_model(None)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in alpaca_rows(64)[0]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))
    print(f"w1, 64 x 64 tokens, {threads} thread(s), output tok/s by CPU seconds\n| params | tok/s |\n|---|---|")
    for name, p in KINDS.items():
        params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=p.temperature, top_p=p.top_p,
                                top_k=p.top_k, seed=p.seed)
        llm.reset_prefix_cache()
        t0 = time.process_time()
        outs = llm.generate(prompts, params)
        print(f"| {name} | {sum(o.num_output_tokens for o in outs) / (time.process_time() - t0):.1f} |")


def timed(fn: object, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--logits", choices=["random", "model"], default="random",
                    help="random: N(0, 2.5^2) (flat: a large nucleus, the kernel's slow case); model: real logits")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--index-select", action="store_true", help="time torch's index_select vs x[rows] only")
    ap.add_argument("--generate", action="store_true", help="whole generations of w1 per setting instead")
    ap.add_argument("--threads", type=int, default=1, help="with --generate (default 1)")
    args = ap.parse_args()
    if args.generate:
        return generate(args.threads)
    if args.logits == "model":
        logits = model_logits(args.rows)
    else:
        logits = (torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 2.5).to(
            torch.bfloat16)
    rows = torch.arange(logits.shape[0])
    if args.index_select:
        print(f"index_select: {timed(lambda: logits.index_select(0, rows), args.repeat) * 1e3:.1f} ms, "
              f"x[rows]: {timed(lambda: logits[rows], args.repeat) * 1e3:.1f} ms ({tuple(logits.shape)} bf16)")
        return
    print(f"[{logits.shape[0]}, {logits.shape[1]}] bf16 logits ({args.logits}), {torch.get_num_threads()} threads; "
          f"ms per step")
    print("| rows' params | C++ kernel | torch ops | ratio |\n|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, params in KINDS.items():
        ps = [params] * logits.shape[0]
        idx = [0] * logits.shape[0]
        kernel = timed(lambda ps=ps, idx=idx: sampler.sample(logits, ps, idx, gen), args.repeat)
        real_ops = sampler.cpu_ops
        sampler.cpu_ops = lambda: None
        try:
            ops = timed(lambda ps=ps, idx=idx: sampler.sample(logits, ps, idx, gen), args.repeat)
        finally:
            sampler.cpu_ops = real_ops
        print(f"| {name} | {kernel * 1e3:.1f} | {ops * 1e3:.1f} | {ops / kernel:.1f}x |")
    if cpu_ops() is None:
        print("note: the CPU kernels could not be built here; both columns are the torch ops")


if __name__ == "__main__":
    main()
