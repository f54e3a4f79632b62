"""The vision-language families the vision benchmarks run (bench/vision.py on the CPU, bench/vision_gpu.py on a
GPU), one VisionFamily entry each: the released config.json written inline (the hub is unreachable from the bench
machines), the shapes cut from it (`small`: a CPU side-by-side size, `tiny`: a smoke run), the special tokens its
prompts spell and the config fields holding their ids, its chat template, and its Hugging Face processor's files
written from parts (no files to download). A new family is one more entry in FAMILIES; a family whose architecture
is not in tokenmill's registry yet is skipped by the benchmarks with one line (family_missing). Not written yet:
LLaVA-NeXT and Idefics3/SmolVLM entries (their models landed; each wants its released config, shapes, tokens and
processor).

Also the benchmarks' inputs: pictures drawn with Pillow (gradients, shapes, lines, a word; several sizes and aspect
ratios, as photos come) and real questions (GSM8K test questions from ../shared/data).

Random weights: the shapes and the costs are the real model's, the text is not. Token ids: the benchmarks reuse a
tokenizer the machine has (SmolLM2's here, BERT uncased's on the GPU machine), add the family's special tokens to it
and point the config's token fields at their new ids (with_tokenizer); the vocabulary keeps the released size where
the tokenizer fits in it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

#: llava-hf/llava-1.5-7b-hf's config.json (Vicuna-7B v1.5 on CLIP ViT-L/14 at 336 px: 576 image tokens; the nested
#: configs spell only what differs from LlamaConfig's and CLIPVisionConfig's defaults, as released).
_LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
    "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                    "rms_norm_eps": 1e-05, "vocab_size": 32064},
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
#: Qwen/Qwen2.5-VL-7B-Instruct's config.json (the Qwen2.5-7B decoder with M-RoPE; a 32-block ViT of width 1280 with
#: window attention, 2x2 patch merging into the decoder's width; dynamic resolution).
_QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}

#: LLaVA-1.5's conversation ("USER: <image>\n... ASSISTANT:"), images before the text.
_LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
#: Qwen2.5-VL's ChatML, an image as <|vision_start|><|image_pad|><|vision_end|>.
_QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _llava_processor(tok: Any, config: dict, folder: Path, size: str) -> None:
    """LlavaProcessor as llava-hf's processor_config.json sets it (patch 14, "default" strategy, the CLS row
    counted) over CLIP's Pillow image processor at the config's image size (resize the shortest edge, centre crop),
    saved in `folder`."""
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    v = config["vision_config"]
    side = v["image_size"]
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=v["patch_size"],
                                vision_feature_select_strategy=config["vision_feature_select_strategy"],
                                num_additional_image_tokens=1, chat_template=tok.chat_template).save_pretrained(folder)


def _qwen_vl_processor(tok: Any, config: dict, folder: Path, size: str) -> None:
    """Qwen2.5-VL's processor files in `folder` as its hub folder holds them (preprocessor_config.json naming
    Qwen2_5_VLProcessor, the tokenizer, chat_template.jinja; its video processor needs torchvision, so
    engine.multimodal.processor loads the image half): Qwen2-VL's Pillow image processor with the release's pixel
    bounds (3,136 to 12,845,056 pixels: 4 to 16,384 merged tokens a picture; `size` "tiny": 4 to 16)."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = config["vision_config"]
    bounds = (56 * 56, 112 * 112) if size == "tiny" else (56 * 56, 28 * 28 * 16384)
    Qwen2VLImageProcessorPil(size={"shortest_edge": bounds[0], "longest_edge": bounds[1]}, patch_size=v["patch_size"],
                             merge_size=v["spatial_merge_size"], temporal_patch_size=v["temporal_patch_size"]
                             ).save_pretrained(folder)
    tok.save_pretrained(folder)
    pre = folder / "preprocessor_config.json"
    pre.write_text(json.dumps(json.loads(pre.read_text()) | {"processor_class": "Qwen2_5_VLProcessor"}))
    (folder / "chat_template.jinja").write_text(tok.chat_template)


@dataclasses.dataclass(frozen=True)
class VisionFamily:
    """One vision-language family of the benchmarks.

    architecture: the registry name tokenmill needs (engine.model.registry.MODELS). config: the released
    config.json. small / tiny: overrides merged into it (nested dicts merged key by key) for the CPU side by side
    and for smoke runs. tokens: config field -> the special token whose id it holds (the image token first).
    vocab_fields: paths of the vocabulary size in the config. template: the chat template (jinja). processor:
    (HF tokenizer, config, folder, size) -> None: writes the family's HF processor files into the folder."""

    architecture: str
    config: dict
    small: dict
    tiny: dict
    tokens: dict[str, str]
    vocab_fields: tuple[tuple[str, ...], ...]
    template: str
    processor: Callable[[Any, dict, Path, str], None]


_LLAVA_VISION_SMALL = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                       "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "projection_dim": 512}
FAMILIES: dict[str, VisionFamily] = {
    "llava-1.5-7b": VisionFamily(
        "llava", _LLAVA_15_7B,
        # CLIP ViT-B/16 at 224 px (196 image tokens) on a 12-layer Llama of width 768 (~150M with embeddings)
        small={"vision_config": _LLAVA_VISION_SMALL,
               "text_config": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                               "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 2048}},
        tiny={"vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "image_size": 56, "patch_size": 14, "projection_dim": 32},
              "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}},
        tokens={"image_token_index": "<image>"}, vocab_fields=(("vocab_size",), ("text_config", "vocab_size")),
        template=_LLAVA_TEMPLATE, processor=_llava_processor),
    "qwen2.5-vl-7b": VisionFamily(
        "qwen2_5_vl", _QWEN25_VL_7B,
        small={"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
               "num_key_value_heads": 4, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
               "vision_config": {"depth": 12, "hidden_size": 768, "intermediate_size": 2048,
                                                           "num_heads": 12, "out_hidden_size": 768,
                                                           "fullatt_block_indexes": [3, 7, 11]}},
        tiny={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
              "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                                "out_hidden_size": 64, "fullatt_block_indexes": [1]}},
        tokens={"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
                "vision_end_token_id": "<|vision_end|>", "vision_token_id": "<|vision_pad|>",
                "video_token_id": "<|video_pad|>"},
        vocab_fields=(("vocab_size",),), template=_QWEN_VL_TEMPLATE, processor=_qwen_vl_processor),
}


def family(name: str) -> VisionFamily:
    """FAMILIES[name]. Raises ValueError listing the known names."""
    if name not in FAMILIES:
        raise ValueError(f"unknown vision family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_missing(name: str) -> str | None:
    """Why tokenmill cannot run `name` yet (one line: its architecture is not in engine.model.registry.MODELS), or
    None when it can."""
    from engine.model.registry import MODELS

    arch = family(name).architecture
    return None if arch in MODELS else f"{name}: skipped: tokenmill's registry has no {arch!r} yet"


def _merged(base: dict, over: dict) -> dict:
    """A deep copy of `base` with `over` merged in (nested dicts key by key, anything else replaced)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def shaped_config(name: str, size: str = "full") -> dict:
    """The config.json dict of family `name` at `size`: "full" (as released), "small" or "tiny". Raises ValueError
    for an unknown family or size."""
    fam = family(name)
    if size not in ("full", "small", "tiny"):
        raise ValueError(f"unknown size {size!r}; known: full, small, tiny")
    return _merged(fam.config, {"full": {}, "small": fam.small, "tiny": fam.tiny}[size])


def with_tokenizer(name: str, size: str, tok: Any, folder: Path, grow_vocab: bool = False) -> dict:
    """Family `name`'s config.json dict at `size` (shaped_config) over the HF tokenizer `tok`, its processor files
    written into `folder` (engine.multimodal.processor.ImageProcessor.from_model_path reads them): the family's
    special tokens added to `tok` (in place) and its chat template set, the config's token fields pointed at their
    ids. grow_vocab: set the config's vocabulary to the tokenizer's size (exactly: a random model emits every id it
    has, and tokenmill's byte-level detokenizer knows only the tokenizer's); otherwise a tokenizer larger than the
    vocabulary raises ValueError (a smaller one leaves ids no text decodes to: WordPiece decoding skips them)."""
    fam = family(name)
    tok.add_special_tokens({"additional_special_tokens": list(fam.tokens.values())})
    tok.chat_template = fam.template
    ids = {field: tok.convert_tokens_to_ids(token) for field, token in fam.tokens.items()}
    config = _merged(shaped_config(name, size), ids)
    for path in fam.vocab_fields:
        holder = config
        for key in path[:-1]:
            holder = holder[key]
        if grow_vocab:
            holder[path[-1]] = len(tok)
        elif len(tok) > holder[path[-1]]:
            raise ValueError(f"{name}: the tokenizer has {len(tok)} tokens, over the vocabulary's {holder[path[-1]]}")
    folder.mkdir(parents=True, exist_ok=True)
    fam.processor(tok, config, folder, size)
    return config


def picture(index: int) -> Image.Image:
    """Picture `index` (deterministic): an RGB photo-like drawing, a two-colour gradient with an ellipse, a
    rectangle, lines and a word, in one of six sizes from 200x300 to 1024x768 (portrait, square, landscape)."""
    import random

    rng = random.Random(index)
    sizes = [(640, 480), (320, 320), (1024, 768), (200, 300), (480, 640), (800, 450)]
    w, h = sizes[index % len(sizes)]

    def colour() -> tuple[int, int, int]:
        return rng.randrange(256), rng.randrange(256), rng.randrange(256)

    a, b = colour(), colour()
    ramp = Image.linear_gradient("L").resize((w, h)).rotate(rng.choice([0, 90, 180, 270]), expand=False)
    img = Image.composite(Image.new("RGB", (w, h), a), Image.new("RGB", (w, h), b), ramp)
    draw = ImageDraw.Draw(img)
    x, y = rng.randrange(w // 2), rng.randrange(h // 2)
    draw.ellipse([x, y, x + rng.randrange(w // 8, w // 2), y + rng.randrange(h // 8, h // 2)], fill=colour())
    x, y = rng.randrange(w // 2), rng.randrange(h // 2)
    draw.rectangle([x, y, x + w // 4, y + h // 5], outline=colour(), width=max(2, w // 100))
    for _ in range(4):
        draw.line([rng.randrange(w), rng.randrange(h), rng.randrange(w), rng.randrange(h)], fill=colour(), width=3)
    draw.text((w // 10, h - h // 6), rng.choice(["tokenmill", "bench", "photo", "street"]), fill=colour())
    return img


def questions(n: int, start: int = 0) -> list[str]:
    """`n` GSM8K test questions from ../shared/data (bench.common.read_column), from the `start`-th on."""
    from bench.common import read_column

    return read_column("gsm8k_test.parquet", "question")[start:start + n]
