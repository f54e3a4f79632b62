"""Vision throughput on a GPU (issue 54): LLMEngine.generate with one picture and one question a row, random weights
of a released vision-language model's shape (bench.vision_models: its config.json written inline, no weights to
carry), greedy with a fixed number of output tokens:

- llava-1.5-7b (llava-hf): Vicuna-7B v1.5 (Llama, 32 layers, width 4096) on CLIP ViT-L/14 at 336 px (24 layers,
  width 1024; 576 image tokens a picture), the two-layer GELU projector: about 7.06B parameters;
- qwen2.5-vl-7b (Qwen): Qwen2.5-7B with M-RoPE on a 32-block ViT of width 1280 (window attention, 2x2 patch
  merging, dynamic resolution at the release's pixel bounds: ~1,000 image tokens for a 1024x768 picture): about
  8.29B;
- gemma-3-4b (google): Gemma 3 4B (34 layers, width 2560, 5 sliding layers to 1 global) on SigLIP So400m/14 at
  896 px (27 layers, width 1152), its 64x64 patches average-pooled to 256 soft tokens a picture: about 4.30B;
- qwen3-vl-8b (Qwen): Qwen3-8B with interleaved M-RoPE on a 27-block ViT of width 1152 (16-pixel patches, 2x2
  merging, DeepStack into the first three layers, dynamic resolution from 64 to 16,384 image tokens): about 8.77B;
- smolvlm-256m (HuggingFaceTB): SmolLM2-135M's decoder (30 layers, width 576) on SigLIP B/16 at 512 px tiles
  (12 layers, width 768), a 4x pixel shuffle: 64 image tokens a tile (a 1024x768 picture: 4x3 tiles and the whole,
  832): about 256M.
A family whose architecture tokenmill's registry lacks is skipped with one line (family_missing).

Inputs: bench.vision_models.picture's drawings (six sizes, 200x300 to 1024x768) through the family's own HF processor
(CLIP's resize and crop; Gemma 3's square resize; Qwen2-VL's dynamic resolution; Idefics3's tiles), GSM8K test questions
in the family's chat template, the BERT uncased tokenizer bench/gpu_prepare.sh carries (.gpu/bert_tokenizer: the
released tokenizers do not travel) with the family's image tokens added and the config's token ids pointed at them; the
vocabulary stays the released one. One untimed pass over other pictures and questions (kernels, CUDA graphs, allocator;
no prefix or encoder cache carries over), then one timed pass. Prints one JSON line per family (images/s, output
tokens/s, and images and output tokens per dollar at --price-per-hour) and a table.

Usage (bench/gpu_session.sh's `vision` step):
    python -m bench.vision_gpu --device cuda                                 # every family, 256 rows x 128 tokens
    python -m bench.vision_gpu --device cuda --family llava-1.5-7b --images 1024 --price-per-hour 3.5
Smoke run on a CPU (each shape cut to 2 layers of width 64, 4 to 20 image tokens a picture:
tests/bench/test_vision_bench.py):
    python -m bench.vision_gpu --device cpu --tiny --images 4 --max-tokens 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import emit, preset_parser
from bench.embed_gpu import tokenizer_folder
from bench.vision_models import FAMILIES, family_missing, picture, questions, with_tokenizer

if TYPE_CHECKING:
    from engine import EngineConfig, LLMEngine
    from engine.config import ModelConfig
    from engine.multimodal.processor import ImageProcessor

#: Rows of the warm-up pass (pictures and questions of their own, from _WARM_FROM on).
_WARMUP = 8
_WARM_FROM = 1000


def vision_preset(name: str, tokenizer_path: str, tiny: bool = False) -> tuple[ModelConfig, ImageProcessor, Any]:
    """(ModelConfig, ImageProcessor, HF tokenizer) of family `name` at its released shape (`tiny`: the family's tiny
    shape), its config.json read as LLMEngine.from_model reads it (engine.model.hf_config.config_from_hf) and its
    processor files as from_model_path reads them, over the tokenizer of the folder `tokenizer_path` with the
    family's special tokens added (bench.vision_models.with_tokenizer). Raises ValueError for an unknown family, a
    family tokenmill does not run, or a tokenizer larger than the vocabulary."""
    from engine.model.hf_config import config_from_hf
    from engine.multimodal.processor import ImageProcessor
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(tokenizer_path).hf_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_hf(with_tokenizer(name, "tiny" if tiny else "full", tok, Path(tmp)))
        return cfg, ImageProcessor.from_model_path(tmp, cfg.vision), tok


def preset_engine(name: str, config: EngineConfig, tokenizer_path: str, *, tiny: bool = False,
                  seed: int = 0) -> LLMEngine:
    """An engine over random N(0, 0.02) weights of family `name` (vision_preset; engine.loading.presets.
    random_model, built on the meta device and materialized once) on config.device in config.dtype, with the
    family's processor. Raises ValueError as vision_preset."""
    from engine import LLMEngine
    from engine.loading.presets import random_model
    from engine.text.tokenizer import Tokenizer
    from engine.worker.device import resolve_device, resolve_dtype

    cfg, images, tok = vision_preset(name, tokenizer_path, tiny)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model = random_model(cfg, dtype, device, seed=seed, max_positions=config.max_model_len)
    return LLMEngine(model, cfg, Tokenizer(tok), config, f"{name}{' (tiny)' if tiny else ''} (random weights)",
                     device, dtype, image_processor=images)


def measure(engine: LLMEngine, images: int, max_tokens: int) -> dict:
    """Seconds (wall, one timed pass after an untimed one of _WARMUP other rows), images, prompt and output tokens of
    `images` rows of max_tokens greedy tokens (EOS ignored). generate returns host token ids, so the time includes
    the device's work and the image processing on the host. Raises RuntimeError when a row fails."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def run(n: int, start: int) -> list:
        prompts = [{"prompt": q, "images": [picture(start + i)]} for i, q in enumerate(questions(n, start))]
        outs = engine.generate(prompts, params)
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{len(errors)} of {n} rows failed: {errors[:2]}")
        return outs

    run(min(_WARMUP, images), _WARM_FROM)
    t0 = time.perf_counter()
    outs = run(images, 0)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "images": len(outs), "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "output_tokens": sum(len(o.output_token_ids) for o in outs)}


def run_family(name: str, config: EngineConfig, args: argparse.Namespace) -> dict:
    """One family's row: its engine (preset_engine) measured (measure), with images and output tokens per second
    and per dollar at args.price_per_hour."""
    engine = preset_engine(name, config, tokenizer_folder(args.tokenizer), tiny=args.tiny)
    got = measure(engine, args.images, args.max_tokens)
    row = {"family": name, "tiny": args.tiny, "device": engine.device_name,
           "dtype": str(engine.dtype).removeprefix("torch."), **got, "price_per_hour_usd": args.price_per_hour}
    hours = got["seconds"] / 3600
    for count in ("images", "output_tokens"):
        row[f"{count}_per_s"] = round(got[count] / got["seconds"], 2)
        row[f"{count}_per_dollar"] = round(got[count] / (hours * args.price_per_hour))
    row["seconds"] = round(got["seconds"], 6)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark (module docstring); returns the rows it printed (skipped families print one line)."""
    ap = preset_parser(__doc__, "--family", list(FAMILIES),
                       "2 layers of width 64, 4 to 20 image tokens a picture (a CPU smoke run)")
    ap.add_argument("--images", type=int, default=256, help="rows (one picture and one question each)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens a row (greedy, EOS ignored)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="tokens a row may hold (prompt + output)")
    args = ap.parse_args(argv)

    import torch

    from engine import EngineConfig

    config = EngineConfig(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
    rows = []
    for name in args.family or list(FAMILIES):
        missing = family_missing(name)
        if missing:
            print(missing)
            continue
        rows.append(run_family(name, config, args))
        emit(**rows[-1])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next family's weights in the room this one's left
    columns = (("images_per_s", "images/s"), ("output_tokens_per_s", "out tok/s"), ("images_per_dollar", "images/$"),
               ("output_tokens_per_dollar", "out tok/$"))
    print(f"{'family':16s}" + "".join(f" {title:>12s}" for _, title in columns) + "  device")
    for r in rows:
        print(f"{r['family']:16s}" + "".join(f" {r[key]:12,}" for key, _ in columns) + f"  {r['device']} {r['dtype']}")
    return rows


if __name__ == "__main__":
    main()
