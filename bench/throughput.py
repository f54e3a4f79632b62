"""Throughput: our engine vs HF transformers `generate` on the same real prompts, same process, same device.

Usage (CPU, the default SmolLM2-135M GGUF in fp32):
    python bench/throughput.py --num-prompts 64 --max-tokens 64
Prints output tokens/s of both and the ratio. EOS is ignored (ignore_eos for ours, min_new_tokens for HF) so both do
the same work, as in vLLM's throughput benchmark. Workloads:
    w1: every request generates --max-tokens tokens.
    w2: each request generates as many tokens as its AlpacaEval reference answer (capped at --max-tokens): the
        variable-length case where continuous batching matters. HF's static batch runs until its longest request;
        only each request's own tokens count as output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.loader import resolve_model_path  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def alpaca_rows(n: int) -> tuple[list[str], list[str]]:
    """The first n AlpacaEval instructions and reference answers (real text, varied lengths)."""
    path = Path(os.environ.get("TOKENMILL_DATA_DIR", DATA)) / "alpaca_eval.parquet"
    t = pq.read_table(path, columns=["instruction", "reference_output"]).slice(0, n)
    return t.column("instruction").to_pylist(), t.column("reference_output").to_pylist()


def run_ours(engine: LLMEngine, prompt_ids: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
    """Seconds and output tokens for one generate over all prompts."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    outs = engine.generate(prompt_ids, params)
    return time.perf_counter() - t0, sum(o.num_output_tokens for o in outs)


def run_hf(model: torch.nn.Module, prompt_ids: list[list[int]], max_tokens: list[int], batch_size: int,
           pad_id: int, device: torch.device) -> tuple[float, int]:
    """Seconds and useful output tokens for HF static batched generate (left padding), batches in prompt order;
    a batch runs until its longest request."""
    t0 = time.perf_counter()
    total = 0
    for i in range(0, len(prompt_ids), batch_size):
        batch, lens = prompt_ids[i:i + batch_size], max_tokens[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                                 min_new_tokens=max(lens), do_sample=False, pad_token_id=pad_id)
        total += sum(min(m, out.shape[1] - width) for m in lens)
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path or URL (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--workload", choices=["w1", "w2"], default="w1")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (w1) or the cap (w2)")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    path = resolve_model_path(args.model)
    engine = LLMEngine.from_model(path, EngineConfig(device=args.device, dtype="float32",
                                                     max_num_seqs=args.max_num_seqs))
    prompts, references = alpaca_rows(args.num_prompts)
    prompt_ids = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    if args.workload == "w1":
        max_tokens = [args.max_tokens] * len(prompts)
    else:
        max_tokens = [max(1, min(args.max_tokens, len(engine.tokenizer.encode(r)))) for r in references]
    run_ours(engine, prompt_ids[:2], [4, 4])  # warm-up
    ours_s, ours_tok = run_ours(engine, prompt_ids, max_tokens)

    rows = [("tokenmill", ours_s, ours_tok)]
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).to(args.device).eval()
        pad = engine.eos_token_id if engine.eos_token_id is not None else 0
        run_hf(hf, prompt_ids[:2], [4, 4], 2, pad, torch.device(args.device))  # warm-up
        hf_s, hf_tok = run_hf(hf, prompt_ids, max_tokens, args.hf_batch_size, pad, torch.device(args.device))
        rows.append((f"HF generate (static batch {args.hf_batch_size})", hf_s, hf_tok))

    prompt_tokens = sum(len(p) for p in prompt_ids)
    print(f"\ndevice={engine.device_name} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"prompts={len(prompt_ids)} (AlpacaEval, {prompt_tokens} prompt tokens) workload={args.workload} "
          f"max_tokens={args.max_tokens}")
    print(f"{'engine':<34} {'seconds':>9} {'out tokens':>11} {'out tok/s':>10} {'ratio':>7}")
    base = rows[-1][2] / rows[-1][1]
    for name, s, tok in rows:
        print(f"{name:<34} {s:>9.2f} {tok:>11d} {tok / s:>10.1f} {tok / s / base:>6.2f}x")


if __name__ == "__main__":
    main()
