"""vLLM's CPU build as the vision peer, run by bench.vision in its own virtual environment (bench.vision
--vllm-python): it imports only the standard library, Pillow and vLLM, never tokenmill.

Usage (bench.vision calls it; by hand for a check):
    VLLM_PYTHON -m bench.vision_peer --model FOLDER --rows ROWS.json --max-tokens N RESULT.json

ROWS.json: a list of {"set": "warm" | "data", "prompt": the rendered chat text, "image": a PNG path}. `LLM(model=
FOLDER)` with its defaults but its memory share (0.25 of the RAM: its default, 0.92, fails to start beside any other
process) and one image a prompt; `LLM.generate` of the "warm" rows untimed, then of the "data" rows timed (wall
time), greedy, max_tokens N with EOS ignored. Writes {"seconds", "output_tokens", "dtype", "version", "settings",
"load_average" (1 minute, at the end of the timed pass)} to RESULT, or {"status": "failed", "detail"} when vLLM's
model class for the folder does not import (its venv lacks a package: its llava imports transformers' Pixtral
processor, which needs torchvision).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def unimportable(folder: Path) -> str | None:
    """Why vLLM's model class of the folder's architecture does not import here (one line), or None when it does:
    vLLM's own error is a validation error whose cause is only in its log."""
    import importlib

    from vllm.model_executor.models.registry import _VLLM_MODELS

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    if arch not in _VLLM_MODELS:
        return f"vLLM {_version()} has no {arch}"
    module = _VLLM_MODELS[arch][0]
    try:
        importlib.import_module(f"vllm.model_executor.models.{module}")
    except ImportError as e:
        return f"vLLM's {module} model does not import in its venv: {type(e).__name__}: {e}"
    return None


def _version() -> str:
    import vllm

    return vllm.__version__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rows", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("result", type=Path)
    args = ap.parse_args()

    import vllm
    from PIL import Image
    from vllm import LLM, SamplingParams

    failed = unimportable(args.model)
    if failed:
        args.result.write_text(json.dumps({"status": "failed", "detail": failed}))
        return
    listed = json.loads(args.rows.read_text())
    prompts = {tag: [{"prompt": r["prompt"], "multi_modal_data": {"image": Image.open(r["image"]).convert("RGB")}}
                     for r in listed if r["set"] == tag] for tag in ("warm", "data")}
    llm = LLM(model=str(args.model), gpu_memory_utilization=0.25, limit_mm_per_prompt={"image": 1}, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts["warm"], params, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts["data"], params, use_tqdm=False)
    seconds, load = time.perf_counter() - t0, os.getloadavg()[0]
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    args.result.write_text(json.dumps({"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids)
                                                                                for o in outs),
                                       "dtype": dtype, "version": vllm.__version__, "settings": "defaults",
                                       "load_average": round(load, 2)}))


if __name__ == "__main__":
    main()
