"""Structured outputs on the real model (issue 30): schema validity with vs without the constraint, its throughput
cost, a 16-schema mix, 12-choice classification, and the greedy default path A/B against another tree.

Usage:
    python -m bench.structured                       # 64 GSM8K rows, max_tokens 128; 64 AlpacaEval rows; 1 round
    python -m bench.structured --rows 256 --max-tokens 256 --classify-rows 256    # the issue's full sizes
    python -m bench.structured --ab-tree ../base  # + the greedy default path: 64 AlpacaEval prompts, 32 tokens,
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

import jsonschema
import pyarrow.parquet as pq

from bench.common import ROOT, data_file, new_parser
from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from engine.loading.model_files import default_model_path

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


def timed(llm: LLMEngine, prompts: list[str], params: list[SamplingParams] | SamplingParams) -> tuple[list, dict]:
    """Run one generate call; returns its outputs and its costs: wall seconds, CPU seconds of this process
    (time.process_time: what a shared, loaded machine disturbs least), steps, and the CPU seconds spent in the
    logits processors (engine.sample.logits_processors: the bitmask fill, its application, the matchers' accept: what
    constraining adds to a step)."""
    procs = llm.logits_processors
    spent = [0.0]
    apply, record = procs.apply, procs.record

    def timed_apply(*a):  # noqa: ANN002, ANN202
        c = time.process_time()
        try:
            return apply(*a)
        finally:
            spent[0] += time.process_time() - c

    def timed_record(*a):  # noqa: ANN002, ANN202
        c = time.process_time()
        try:
            return record(*a)
        finally:
            spent[0] += time.process_time() - c

    procs.apply, procs.record = timed_apply, timed_record
    steps = llm.num_steps
    t, c = time.perf_counter(), time.process_time()
    try:
        outs = llm.generate(prompts, params)
    finally:
        procs.apply, procs.record = apply, record
    cost = {"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c, "steps": llm.num_steps - steps,
            "logits_processors_cpu_s": spent[0]}
    return outs, cost


def extraction(llm: LLMEngine, mode: str, rows: int, max_tokens: int) -> dict:
    """One extraction run (`mode`: unconstrained, constrained or mix) on the first `rows` GSM8K questions."""
    qs = pq.read_table(data_file("gsm8k_test.parquet"), columns=["question"]).column("question").to_pylist()[:rows]
    prompts = [q + INSTRUCTION for q in qs]
    schemas = mix_schemas() if mode == "mix" else [SCHEMA]
    specs = [StructuredOutputsParams(json_schema=json.dumps(s)) for s in schemas]
    t = time.perf_counter()
    for spec in specs:  # compile outside the timing (cached afterwards)
        llm.structured_outputs.grammar(spec)
    compile_s = time.perf_counter() - t
    params = [SamplingParams(max_tokens=max_tokens, structured_outputs=None if mode == "unconstrained"
                             else specs[i % len(specs)]) for i in range(rows)]
    outs, cost = timed(llm, prompts, params)
    tokens = sum(o.num_output_tokens for o in outs)
    stopped, ok = share_valid(outs, [schemas[i % len(schemas)] for i in range(rows)])
    length = sum(o.finish_reason == "length" for o in outs)
    res = {"mode": mode, "rows": rows, "max_tokens": max_tokens, "output_tokens": tokens, "stop": stopped,
           "valid_of_stop": ok, "length": length, "errors": sum(o.finish_reason == "error" for o in outs),
           "compile_s": compile_s, **cost, "cpu_s_per_token": cost["cpu_s"] / max(tokens, 1)}
    print(f"{mode:>13}: {rows} rows, {tokens} tokens, {cost['steps']} steps, {cost['cpu_s']:.1f} CPU-s "
          f"({1e3 * res['cpu_s_per_token']:.2f} ms/token; {cost['wall_s']:.0f} s wall), logits processors "
          f"{cost['logits_processors_cpu_s']:.2f} CPU-s ({100 * cost['logits_processors_cpu_s'] / cost['cpu_s']:.2f}%)"
          f"; stop {stopped}, of them valid {ok} ({100 * ok / max(stopped, 1):.1f}%); length {length}"
          + (f"; {len(specs)} schemas compiled in {compile_s:.2f} s" if mode != "unconstrained" else ""), flush=True)
    return res


def classification(llm: LLMEngine, rows: int) -> dict:
    """AlpacaEval instructions into the 12 CATEGORIES (choices): the share of outputs that are one of them."""
    ins = pq.read_table(data_file("alpaca_eval.parquet"), columns=["instruction"]).column("instruction").to_pylist()
    prompts = [f"Classify this request into one of: {', '.join(CATEGORIES)}.\nRequest: {q}\nCategory:"
               for q in ins[:rows]]
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choices=CATEGORIES))
    outs, cost = timed(llm, prompts, params)
    inside = sum(o.text in CATEGORIES for o in outs)
    counts = {c: sum(o.text == c for o in outs) for c in CATEGORIES}
    print(f"     classify: {rows} AlpacaEval rows into 12 choices in {cost['cpu_s']:.1f} CPU-s: {inside}/{rows} "
          f"({100 * inside / rows:.1f}%) are one of them; {counts}", flush=True)
    return {"mode": "classify", "rows": rows, "inside": inside, "counts": counts, **cost}


_AB = """
import sys, time, torch, pyarrow.parquet as pq
torch.set_num_threads(1)
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loading.model_files import default_model_path
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
        procs = {name: subprocess.Popen([sys.executable, "-c", _AB, str(data_file("alpaca_eval.parquet"))],
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


def logprobs_vs_hf(llm: LLMEngine, rows: int, max_tokens: int = 16, k: int = 5) -> dict:
    """Greedy logprobs (top-k too) of `rows` GSM8K prompts against HF transformers' `generate(output_scores=True)`
    on the same GGUF in fp32 (greedy: the scores are the raw logits), log_softmax of each step's scores."""
    import torch
    import transformers

    qs = pq.read_table(data_file("gsm8k_test.parquet"), columns=["question"]).column("question").to_pylist()[:rows]
    outs = llm.generate(qs, SamplingParams(max_tokens=max_tokens, logprobs=k, ignore_eos=True))
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32).eval()
    chosen = top = 0.0
    same = compared = 0
    for o in outs:
        with torch.inference_mode():
            hf = model.generate(torch.tensor([o.prompt_token_ids]), max_new_tokens=max_tokens, do_sample=False,
                                output_scores=True, return_dict_in_generate=True, min_new_tokens=max_tokens,
                                pad_token_id=0, repetition_penalty=None, temperature=None, top_p=None, top_k=None)
        hf_tokens = hf.sequences[0, len(o.prompt_token_ids):].tolist()
        same += hf_tokens == o.output_token_ids
        for pos, entry in enumerate(o.logprobs):
            if hf_tokens[:pos + 1] != o.output_token_ids[:pos + 1]:
                break  # compare while both decoded the same tokens
            ref = hf.scores[pos][0].float().log_softmax(-1)
            chosen = max(chosen, abs(entry.logprob - ref[entry.token_id].item()))
            values, ids = ref.topk(k)
            if [t.token_id for t in entry.top_logprobs] != ids.tolist():
                top = float("inf")
            else:
                top = max(top, max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, values.tolist(),
                                                                       strict=True)))
            compared += 1
    print(f"     logprobs: {rows} GSM8K prompts x {max_tokens} greedy tokens vs HF output_scores (fp32): "
          f"{same}/{rows} identical token sequences, {compared} positions compared; max |logprob diff| chosen "
          f"{chosen:.2e}, top-{k} {top:.2e}", flush=True)
    return {"mode": "logprobs", "rows": rows, "max_tokens": max_tokens, "identical": same, "positions": compared,
            "max_abs_chosen": chosen, "max_abs_top": top}


def samples(llm: LLMEngine, rows: int, max_tokens: int = 32) -> dict:
    """n = 4 at temperature 0.8 on `rows` AlpacaEval prompts (seeded): prefix-cache hits against the siblings'
    full prompt blocks, distinct samples per prompt, and a second run's samples equal to the first's."""
    ins = pq.read_table(data_file("alpaca_eval.parquet"), columns=["instruction"]).column("instruction").to_pylist()
    prompts = ins[100:100 + rows]
    fresh = llm.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=4 * rows))
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, n=4, seed=1000 + i) for i in range(rows)]
    pool = fresh.kv_cache_manager.pool
    hits = pool.num_cache_hits
    first = fresh.generate(prompts, params)
    hits = pool.num_cache_hits - hits
    bs = fresh.kv_cache_manager.block_size
    sibling_blocks = sum(3 * ((o.num_prompt_tokens - 1) // bs) for o in first)
    distinct = sum(len({tuple(x.output_token_ids) for x in o.samples}) == 4 for o in first)
    fresh.reset_prefix_cache()
    again = fresh.generate(prompts, params)
    same = sum([x.output_token_ids for x in a.samples] == [x.output_token_ids for x in b.samples]
               for a, b in zip(first, again, strict=True))
    print(f"      samples: {rows} AlpacaEval prompts, n=4, temperature 0.8, seeded: {hits} prefix-cache block hits "
          f"(the 3 siblings' full prompt blocks: {sibling_blocks}); {distinct}/{rows} prompts with 4 distinct "
          f"samples; {same}/{rows} identical on a second run", flush=True)
    return {"mode": "samples", "rows": rows, "cache_hits": hits, "sibling_full_blocks": sibling_blocks,
            "distinct": distinct, "reproduced": same}


MODES = ("unconstrained", "constrained", "mix", "classify", "logprobs", "samples")


def run_modes(args: argparse.Namespace) -> list[dict]:
    """Run `args.modes` one after another in this process (one engine, `args.threads` torch threads)."""
    import torch

    torch.set_num_threads(args.threads)
    llm = LLMEngine.from_model(default_model_path(), EngineConfig(
        device="cpu", dtype="float32", max_num_seqs=max(args.rows, args.classify_rows),
        kv_cache_memory_bytes=int(args.kv_gib * (1 << 30))))
    llm.generate(["Hello"], SamplingParams(max_tokens=2))  # warm-up outside the timing
    results = []
    for mode in args.modes:
        res = (classification(llm, args.classify_rows) if mode == "classify" else logprobs_vs_hf(llm, 16)
               if mode == "logprobs" else samples(llm, 16) if mode == "samples"
               else extraction(llm, mode, args.rows, args.max_tokens))
        results.append(res)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(res) + "\n")
    return results


def side_by_side(args: argparse.Namespace) -> None:
    """Each of `args.modes` in its own process, all at once (so they share the machine's load), one thread each."""
    procs = []
    for mode in args.modes:
        cmd = [sys.executable, "-m", "bench.structured", "--modes", mode, "--rows", str(args.rows), "--max-tokens",
               str(args.max_tokens), "--classify-rows", str(args.classify_rows), "--threads", str(args.threads),
               "--kv-gib", str(args.kv_gib)] + (["--out", args.out] if args.out else [])
        procs.append((mode, subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, cwd=ROOT)))
    for mode, proc in procs:
        if proc.wait():
            raise RuntimeError(f"the {mode} run failed (exit {proc.returncode})")


def main() -> None:
    ap = new_parser(__doc__)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--classify-rows", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    ap.add_argument("--kv-gib", type=float, default=5.0, help="KV cache size of each engine (GiB)")
    ap.add_argument("--side-by-side", action="store_true", help="each mode in its own process, all at once")
    ap.add_argument("--out", default=None, help="append each run's figures as a JSON line to this file")
    ap.add_argument("--ab-tree", default=None, help="another checkout to A/B the greedy default path against")
    ap.add_argument("--ab-rounds", type=int, default=1)
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    if args.ab_tree:
        ab(args.ab_tree, args.ab_rounds)
    if args.side_by_side:
        side_by_side(args)
    else:
        run_modes(args)


if __name__ == "__main__":
    main()
