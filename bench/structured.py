"""Structured outputs on the real model (issue 30): schema validity with vs without the constraint, its throughput
cost, a 16-schema mix, 12-choice classification, and the greedy default path A/B against another tree.

Usage:
    python bench/structured.py                       # 64 GSM8K rows, max_tokens 128; 64 AlpacaEval rows; 1 round
    python bench/structured.py --rows 256 --max-tokens 256 --classify-rows 256    # the issue's full sizes
    python bench/structured.py --ab-tree ../base  # + the greedy default path: 64 AlpacaEval prompts, 32 tokens,
                                                  #   this tree vs that one (e.g. `git archive` of the base commit),
                                                  #   side by side, one thread each, tokens per CPU-second

Extraction: GSM8K questions asked for {"answer": <integer>, "reasoning": <string>}; greedy; the share of rows that
finish with "stop" whose text parses and validates against the schema (jsonschema), with the constraint and without
it (the same prompt, free text); output tokens per second of each (same rows, same engine, in one process). The mix:
the same rows under 16 distinct schemas (field names, order, bounds), each compiled once. Classification: AlpacaEval
instructions into 12 fixed categories: the share of outputs that are one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams  # noqa: E402
from engine.loader import default_model_path  # noqa: E402

DATA = Path(os.environ.get("TOKENMILL_DATA_DIR", ROOT.parent / "shared" / "data"))
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "reasoning": {"type": "string"}},
          "required": ["answer", "reasoning"], "additionalProperties": False}
INSTRUCTION = ('\nReply with only a JSON object {"answer": <integer>, "reasoning": <string>}: the final answer as an '
               "integer and a one-sentence reasoning.")
CATEGORIES = ("writing", "coding", "math", "science", "history", "geography", "cooking", "health", "business",
              "entertainment", "travel", "other")


def mix_schemas() -> list[dict]:
    """16 distinct schemas of the same extraction: other field names, order and bounds."""
    names = [("answer", "reasoning"), ("result", "explanation"), ("value", "why"), ("final", "steps")]
    out = []
    for i in range(16):
        num, text = names[i % 4]
        props = {num: {"type": "integer", **({"minimum": 0} if i % 8 >= 4 else {})},
                 text: {"type": "string", **({"maxLength": 200} if i >= 8 else {})}}
        if i % 2:
            props = dict(reversed(list(props.items())))
        out.append({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    return out


def share_valid(outs: list, schemas: list[dict]) -> tuple[int, int]:
    """(rows that stopped, of them the ones whose text parses and validates against their schema)."""
    stopped = ok = 0
    for o, schema in zip(outs, schemas, strict=True):
        if o.finish_reason != "stop":
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(o.text), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return stopped, ok


def timed(llm: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> tuple[list, float]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - t


def extraction(llm: LLMEngine, rows: int, max_tokens: int) -> None:
    qs = pq.read_table(DATA / "gsm8k_test.parquet", columns=["question"]).column("question").to_pylist()[:rows]
    prompts = [q + INSTRUCTION for q in qs]
    free = SamplingParams(max_tokens=max_tokens)
    con = SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json_schema=json.dumps(
        SCHEMA)))
    llm.structured_outputs.grammar(con.structured_outputs)  # compile outside the timing (cached afterwards)
    schemas = mix_schemas()
    mix = [SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(
        json_schema=json.dumps(schemas[i % 16]))) for i in range(rows)]
    t = time.perf_counter()
    for s in schemas:
        llm.structured_outputs.grammar(StructuredOutputsParams(json_schema=json.dumps(s)))
    compile_s = time.perf_counter() - t
    runs = {}
    for name, params, row_schemas in (("unconstrained", [free] * rows, [SCHEMA] * rows),
                                      ("constrained", [con] * rows, [SCHEMA] * rows),
                                      ("16-schema mix", mix, [schemas[i % 16] for i in range(rows)])):
        outs, secs = timed(llm, prompts, params)
        tokens = sum(o.num_output_tokens for o in outs)
        stopped, ok = share_valid(outs, row_schemas)
        runs[name] = tokens / secs
        print(f"{name:>15}: {rows} rows, {tokens} tokens in {secs:.1f} s = {tokens / secs:.1f} tok/s; "
              f"stop {stopped}/{rows}, of them valid {ok}/{stopped} ({100 * ok / max(stopped, 1):.0f}%); "
              f"length {sum(o.finish_reason == 'length' for o in outs)}", flush=True)
    print(f"throughput constrained / unconstrained: {runs['constrained'] / runs['unconstrained']:.3f}; "
          f"16-schema mix / unconstrained: {runs['16-schema mix'] / runs['unconstrained']:.3f}; "
          f"16 schemas compiled in {compile_s:.2f} s")


def classification(llm: LLMEngine, rows: int) -> None:
    ins = pq.read_table(DATA / "alpaca_eval.parquet", columns=["instruction"]).column("instruction").to_pylist()
    prompts = [f"Classify this request into one of: {', '.join(CATEGORIES)}.\nRequest: {q}\nCategory:"
               for q in ins[:rows]]
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choices=CATEGORIES))
    outs, secs = timed(llm, prompts, params)
    inside = sum(o.text in CATEGORIES for o in outs)
    counts = {c: sum(o.text == c for o in outs) for c in CATEGORIES}
    print(f" classification: {rows} AlpacaEval rows into 12 choices in {secs:.1f} s: {inside}/{rows} "
          f"({100 * inside / rows:.0f}%) are one of them; {counts}")


_AB = """
import sys, time, torch, pyarrow.parquet as pq
torch.set_num_threads(1)
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import default_model_path
ins = pq.read_table(sys.argv[1], columns=["instruction"]).column("instruction").to_pylist()[:64]
llm = LLMEngine.from_model(default_model_path(), EngineConfig(device="cpu", dtype="float32"))
llm.generate(ins[:4], SamplingParams(max_tokens=4))
t, c = time.perf_counter(), time.process_time()
outs = llm.generate(ins, SamplingParams(max_tokens=32, ignore_eos=True))
n = sum(o.num_output_tokens for o in outs)
print(n / (time.process_time() - c), n / (time.perf_counter() - t))
"""


def ab(tree: str, rounds: int) -> None:
    """The greedy default path (64 AlpacaEval prompts, 32 tokens each): this tree vs `tree`, each in a fresh
    process with one torch thread, both at once (so they share the machine's load), `rounds` times; output tokens per
    CPU-second of the process (what a loaded machine disturbs least) and per wall second."""
    rates: dict[str, list[tuple[float, float]]] = {"this tree": [], tree: []}
    for _ in range(rounds):
        procs = {name: subprocess.Popen([sys.executable, "-c", _AB, str(DATA / "alpaca_eval.parquet")],
                                        stdout=subprocess.PIPE, text=True, cwd=path,
                                        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
                 for name, path in (("this tree", str(ROOT)), (tree, tree))}
        for name, proc in procs.items():
            out, _ = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"the A/B run of {name} failed (exit {proc.returncode})")
            cpu, wall = map(float, out.strip().splitlines()[-1].split())
            rates[name].append((cpu, wall))
            print(f"   greedy A/B: {name}: {cpu:.1f} tok per CPU-s, {wall:.1f} tok/s wall", flush=True)
    mine, base = max(r[0] for r in rates["this tree"]), max(r[0] for r in rates[tree])
    print(f"greedy default path, best of {rounds}: this tree {mine:.1f}, {tree} {base:.1f} output tokens per "
          f"CPU-second; ratio {mine / base:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--classify-rows", type=int, default=64)
    ap.add_argument("--ab-tree", default=None, help="another checkout to A/B the greedy default path against")
    ap.add_argument("--ab-rounds", type=int, default=1)
    ap.add_argument("--skip", nargs="*", default=(), choices=("extraction", "classification"))
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    if args.ab_tree:
        ab(args.ab_tree, args.ab_rounds)
    llm = LLMEngine.from_model(default_model_path(), EngineConfig(device="cpu", dtype="float32",
                                                                  max_num_seqs=max(args.rows, args.classify_rows)))
    if "extraction" not in args.skip:
        extraction(llm, args.rows, args.max_tokens)
    if "classification" not in args.skip:
        classification(llm, args.classify_rows)


if __name__ == "__main__":
    main()
