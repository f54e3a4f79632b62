"""The systems of bench/peers.py, each run as a worker in its own fresh interpreter (`python -m bench.peers --worker
SYSTEM SPEC RESULT`, bench.common.run_worker): tokenmill (plain or INT8), HF transformers, CTranslate2 and
llama.cpp's llama-server, each loading its model, warming up on two requests (their first CHECK_TOKENS greedy tokens
are compared with tokenmill's) and generating the workload's prompts (token ids in the spec) for its row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import ROOT
from bench.throughput import run_hf, run_ours

CHECK_TOKENS = 8  # the warm-up: 2 requests x 8 greedy tokens, compared with tokenmill's as a sanity check


class NotInstalled(Exception):
    """A peer's package is missing: its row says so instead of failing the run."""



def worker_tokenmill(spec: dict, quantization: str = "none") -> dict:
    from engine import EngineConfig, LLMEngine, SamplingParams

    t0 = time.perf_counter()
    # The default EngineConfig (device auto, dtype auto), or only its quantization changed.
    engine = LLMEngine.from_model(spec["model"], EngineConfig(quantization=quantization))
    load_s = time.perf_counter() - t0
    prompts, n_tok = spec["prompt_ids"], spec["max_tokens"]
    outs = engine.generate(prompts[:2], SamplingParams(max_tokens=CHECK_TOKENS, ignore_eos=True))  # warm-up
    engine.reset_prefix_cache()
    cpu0 = time.process_time()
    seconds, tokens = run_ours(engine, prompts, [n_tok] * len(prompts), spec["temperature"], spec["top_p"])
    return {"load_s": load_s, "seconds": seconds, "output_tokens": tokens, "cpu_s": time.process_time() - cpu0,
            "check_ids": [list(o.output_token_ids) for o in outs],
            "detail": f"dtype {str(engine.dtype).removeprefix('torch.')}, quantization {quantization}, "
                      f"max_num_seqs {engine.config.max_num_seqs}"}


def worker_hf(spec: dict, dtype_name: str) -> dict:
    import torch

    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise NotInstalled("transformers") from e
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(spec["model"]),
                                                 gguf_file=os.path.basename(spec["model"]),
                                                 dtype=getattr(torch, dtype_name)).eval()
    load_s = time.perf_counter() - t0
    prompts, n_tok, pad = spec["prompt_ids"], spec["max_tokens"], spec["pad_id"]
    width = max(len(p) for p in prompts[:2])  # warm-up, and the check ids
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts[:2]])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts[:2]])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=CHECK_TOKENS,
                             min_new_tokens=CHECK_TOKENS, do_sample=False, pad_token_id=pad)
    cpu0 = time.process_time()
    seconds, tokens = run_hf(model, prompts, [n_tok] * len(prompts), len(prompts), pad, torch.device("cpu"),
                             spec["temperature"], spec["top_p"])
    return {"load_s": load_s, "seconds": seconds, "output_tokens": tokens, "cpu_s": time.process_time() - cpu0,
            "check_ids": out[:, width:].tolist(),
            "detail": f"{dtype_name}, one static batch of {len(prompts)}"}


def ct2_model_dir(spec: dict, quantization: str) -> tuple[Path, float]:
    """The converted CTranslate2 folder for this GGUF and quantization, converting it on first use; returns the
    folder and the seconds spent converting now (0 when cached)."""
    gguf = Path(spec["model"])
    root = Path(spec["cache_dir"]) / f"{gguf.stem}-{gguf.stat().st_size}"
    out = root / f"ct2-{quantization}"
    if (out / "model.bin").is_file():
        return out, 0.0
    t0 = time.perf_counter()
    hf_dir = root / "hf"
    if not (hf_dir / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "bench.peers", "--export-hf", str(gguf), str(hf_dir)], check=True,
                       cwd=ROOT)
    tmp = root / f".ct2-{quantization}.tmp"
    subprocess.run([sys.executable, "-m", "ctranslate2.converters.transformers", "--model", str(hf_dir),
                    "--output_dir", str(tmp), "--quantization", quantization, "--force"], check=True)
    tmp.rename(out)
    return out, time.perf_counter() - t0


def export_hf(gguf: str, out: str) -> None:
    """GGUF -> a plain (dequantized fp32) HF folder with its tokenizer, the converter's input."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(tmp)
    os.replace(tmp, out)


def worker_ct2(spec: dict, quantization: str) -> dict:
    try:
        import ctranslate2
    except ImportError as e:
        raise NotInstalled("ctranslate2 (pip install -e '.[bench]')") from e
    model_dir, convert_s = ct2_model_dir(spec, quantization)
    vocab = json.loads((model_dir / "vocabulary.json").read_text())
    t0 = time.perf_counter()
    gen = ctranslate2.Generator(str(model_dir), device="cpu", compute_type=quantization,
                                intra_threads=spec["threads"], inter_threads=1)
    load_s = time.perf_counter() - t0
    prompts = [[vocab[i] for i in p] for p in spec["prompt_ids"]]
    n_tok = spec["max_tokens"]

    def run(batch: list[list[str]], n: int, sampled: bool = False) -> list[list[int]]:
        how = ({"sampling_topk": 0, "sampling_temperature": spec["temperature"], "sampling_topp": spec["top_p"]}
               if sampled and spec["temperature"] > 0 else {"sampling_topk": 1})
        res = gen.generate_batch(batch, max_length=n, min_length=n, beam_size=1, include_prompt_in_result=False,
                                 **how)
        return [r.sequences_ids[0] for r in res]

    check = run(prompts[:2], CHECK_TOKENS)  # warm-up
    t0, cpu0 = time.perf_counter(), time.process_time()
    tokens = sum(len(ids) for ids in run(prompts, n_tok, sampled=True))
    seconds = time.perf_counter() - t0
    return {"load_s": load_s, "seconds": seconds, "output_tokens": tokens, "convert_s": convert_s,
            "cpu_s": time.process_time() - cpu0,
            "check_ids": check,
            "detail": f"{quantization}, one batch of {len(prompts)}, {spec['threads']} threads"}


def llama_cpp_bin() -> Path:
    """The folder of llama-server, built by bench/build_llama_cpp.sh when missing. Raises NotInstalled when it
    cannot be built here."""
    script = Path(__file__).resolve().parent / "build_llama_cpp.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={**os.environ,
                                                                                       "PYTHON": sys.executable})
    if proc.returncode != 0:
        raise NotInstalled((proc.stderr.strip().splitlines() or [f"build_llama_cpp.sh exit {proc.returncode}"])[-1])
    return Path(proc.stdout.strip().splitlines()[-1])


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process so far (/proc/PID/stat fields 14 and 15, proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_llama_cpp(spec: dict) -> dict:
    import socket

    bin_dir = llama_cpp_bin()
    prompts, n_tok = spec["prompt_ids"], spec["max_tokens"]
    slots = len(prompts)
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    per_slot = max(len(p) for p in prompts) + n_tok + 8
    cmd = [str(bin_dir / "llama-server"), "-m", spec["model"], "--host", "127.0.0.1", "--port", str(port),
           "-t", str(spec["threads"]), "-tb", str(spec["threads"]), "-np", str(slots), "-c", str(per_slot * slots),
           "--no-webui"]
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:  # /health answers 200 once the model is loaded
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited {server.returncode}: {server.stderr.read()[-300:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        load_s = time.perf_counter() - t0

        def complete(ids: list[int], n: int, sampled: bool) -> list[int]:
            how = ({"temperature": spec["temperature"], "top_p": spec["top_p"], "top_k": 0}
                   if sampled and spec["temperature"] > 0 else {"temperature": 0.0, "top_k": 1})
            out = _post(f"{base}/completion", {"prompt": ids, "n_predict": n, "ignore_eos": True,
                                               "cache_prompt": False, "return_tokens": True, **how}, 3600)
            return out["tokens"]

        with ThreadPoolExecutor(max_workers=slots) as pool:
            check = list(pool.map(lambda p: complete(p, CHECK_TOKENS, False), prompts[:2]))  # warm-up
            t0, cpu0 = time.perf_counter(), process_cpu_s(server.pid)
            tokens = sum(len(t) for t in pool.map(lambda p: complete(p, n_tok, True), prompts))
            seconds = time.perf_counter() - t0
            cpu_s = process_cpu_s(server.pid) - cpu0
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {"load_s": load_s, "seconds": seconds, "output_tokens": tokens, "check_ids": check, "cpu_s": cpu_s,
            "detail": f"llama-server Q4 GGUF, -np {slots}, {spec['threads']} threads"}


def worker(system: str, spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        if system.startswith(("tokenmill", "hf-")):  # the others take their threads as arguments, without torch
            import torch

            torch.set_num_threads(spec["threads"])
        if system == "tokenmill":
            row = worker_tokenmill(spec)
        elif system == "tokenmill-int8":
            row = worker_tokenmill(spec, "int8")
        elif system == "llama.cpp":
            row = worker_llama_cpp(spec)
        elif system.startswith("hf-"):
            row = worker_hf(spec, {"hf-fp32": "float32", "hf-bf16": "bfloat16"}[system])
        else:
            row = worker_ct2(spec, system.removeprefix("ct2-"))
        row["status"] = "ok"
    except NotInstalled as e:
        row = {"status": "not installed", "detail": str(e)}
    Path(result_path).write_text(json.dumps(row))


