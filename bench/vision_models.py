"""The vision-language families the vision benchmarks run (bench/vision.py on the CPU, bench/vision_gpu.py on a GPU),
one VisionFamily entry each: the released config.json written inline (bench.vision_configs: the hub is unreachable from
the bench machines), the shapes cut from it (`small`: a CPU side-by-side size, `tiny`: a smoke run), the special tokens
its prompts spell and the config fields holding their ids, its chat template, and its Hugging Face processor's files
written from parts (no files to download). A new family is one more entry in FAMILIES; a family whose architecture is
not in tokenmill's registry yet is skipped by the benchmarks with one line (family_missing). Written: LLaVA-1.5,
Qwen2.5-VL, Gemma 3, Qwen3-VL and SmolVLM (Idefics3's architecture). Not written yet: a LLaVA-NeXT entry (its model
landed; it wants its released config, shapes, tokens and anyres processor).

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

from bench.vision_configs import GEMMA3_4B, LLAVA_15_7B, QWEN3_VL_8B, QWEN25_VL_7B, SMOLVLM_256M

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
#: Gemma 3's turns (google/gemma-3-4b-it's layout: "<start_of_turn>user\n" + parts + "<end_of_turn>\n", an image
#: part as <start_of_image>, which Gemma3Processor expands to its soft tokens; the reply "<start_of_turn>model\n").
_GEMMA3_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

#: SmolVLM's turns ("<|im_start|>User:<image>question<end_of_utterance>\nAssistant:"; a colon and a space before text
#: that opens a turn, a bare colon before an image), images where the parts put them.
_SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}{% if m['content'] is string %}: "
    "{{ m['content'] }}{% else %}{{ ':' if m['content'][0]['type'] == 'image' else ': ' }}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
#: The tokens SmolVLM's image prompts spell besides <image>: the tile frame, the global image's tag, the row and
#: column tags of a split image (up to 6x6) and the end of a turn.
_SMOLVLM_TOKENS = ("<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


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
    """Qwen2.5-VL's or Qwen3-VL's processor files in `folder` as their hub folders hold them (preprocessor_config.json
    naming Qwen2_5_VLProcessor or Qwen3VLProcessor, the tokenizer, chat_template.jinja; their video processors need
    torchvision, so engine.multimodal.processor loads the image half): Qwen2-VL's Pillow image processor with the
    release's settings. Pixel bounds in merged tokens a picture (a merged token: (patch x merge)^2 pixels):
    Qwen2.5-VL's 4 to 16,384 (3,136 to 12,845,056 pixels), Qwen3-VL's 64 to 16,384 (65,536 to 16,777,216 pixels,
    mean and std 0.5); `size` "tiny": 4 to 16."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = config["vision_config"]
    unit = (v["patch_size"] * v["spatial_merge_size"]) ** 2
    qwen3 = config["model_type"] == "qwen3_vl"
    tokens = (4, 16) if size == "tiny" else (64 if qwen3 else 4, 16384)
    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if qwen3 else {}
    Qwen2VLImageProcessorPil(size={"shortest_edge": unit * tokens[0], "longest_edge": unit * tokens[1]},
                             patch_size=v["patch_size"], merge_size=v["spatial_merge_size"],
                             temporal_patch_size=v["temporal_patch_size"], **norm).save_pretrained(folder)
    tok.save_pretrained(folder)
    pre = folder / "preprocessor_config.json"
    name = "Qwen3VLProcessor" if qwen3 else "Qwen2_5_VLProcessor"
    pre.write_text(json.dumps(json.loads(pre.read_text()) | {"processor_class": name}))
    (folder / "chat_template.jinja").write_text(tok.chat_template)


def _gemma3_processor(tok: Any, config: dict, folder: Path, size: str) -> None:
    """Gemma3Processor as google/gemma-3-4b-it's processor files set it (image_seq_length: the config's
    mm_tokens_per_image) over Gemma 3's Pillow image processor at the tower's square size (mean and std 0.5,
    pan-and-scan off), saved in `folder`; the tokenizer names its image tokens (boi_token, eoi_token, image_token)
    as Gemma 3's tokenizer_config.json does, which Gemma3Processor reads."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok.save_pretrained(folder)
    named = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    side = config["vision_config"]["image_size"]
    images = Gemma3ImageProcessorPil(size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    transformers.Gemma3Processor(image_processor=images, tokenizer=named, chat_template=tok.chat_template,
                                 image_seq_length=config["mm_tokens_per_image"]).save_pretrained(folder)


def _smolvlm_processor(tok: Any, config: dict, folder: Path, size: str) -> None:
    """Idefics3Processor as SmolVLM-256M-Instruct's processor files set it (image_seq_len: the image tokens a tile,
    (image_size / patch_size)^2 / scale_factor^2) over Idefics3's Pillow image processor (the picture resized to
    vision_config's size.longest_edge, split into tiles of its max_image_size plus the whole picture at one tile's
    size; LANCZOS, mean and std 0.5: the processor's defaults, as released), saved in `folder`."""
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    v = config["vision_config"]
    images = Idefics3ImageProcessorPil(size=v["size"], max_image_size=v["max_image_size"])
    per_tile = (v["image_size"] // v["patch_size"]) ** 2 // config["scale_factor"] ** 2
    transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=per_tile,
                                   chat_template=tok.chat_template).save_pretrained(folder)


@dataclasses.dataclass(frozen=True)
class VisionFamily:
    """One vision-language family of the benchmarks.

    architecture: the registry name tokenmill needs (engine.model.registry.MODELS). config: the released
    config.json. small / tiny: overrides merged into it (nested dicts merged key by key) for the CPU side by side
    and for smoke runs. tokens: config field -> the special token whose id it holds (the image token first).
    vocab_fields: paths of the vocabulary size in the config. template: the chat template (jinja). processor:
    (HF tokenizer, config, folder, size) -> None: writes the family's HF processor files into the folder.
    extra_tokens: special tokens its prompts spell that no config field holds (Gemma 3's turn markers,
    SmolVLM's tile tags)."""

    architecture: str
    config: dict
    small: dict
    tiny: dict
    tokens: dict[str, str]
    vocab_fields: tuple[tuple[str, ...], ...]
    template: str
    processor: Callable[[Any, dict, Path, str], None]
    extra_tokens: tuple[str, ...] = ()


_LLAVA_VISION_SMALL = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                       "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "projection_dim": 512}
_SIGLIP_SMALL = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "patch_size": 14}
_SIGLIP_TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "image_size": 56, "patch_size": 7}
FAMILIES: dict[str, VisionFamily] = {
    "llava-1.5-7b": VisionFamily(
        "llava", LLAVA_15_7B,
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
        "qwen2_5_vl", QWEN25_VL_7B,
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
    "gemma-3-4b": VisionFamily(
        "gemma3_vl", GEMMA3_4B,
        # SigLIP-B/14 at 224 px (16x16 patches pooled 4x4 to 16 soft tokens, the release's kernel) on a 12-layer
        # Gemma 3 of width 768 (two global layers: the 5-to-1 pattern)
        small={"vision_config": _SIGLIP_SMALL | {"image_size": 224}, "mm_tokens_per_image": 16,
               "text_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                               "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
                               "query_pre_attn_scalar": 64, "max_position_embeddings": 2048}},
        # 56 px pictures in 7-pixel patches, 8x8 pooled 2x2 to 16 soft tokens; one sliding layer, one global
        tiny={"vision_config": _SIGLIP_TINY, "mm_tokens_per_image": 16,
              "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "query_pre_attn_scalar": 16, "sliding_window": 16, "max_position_embeddings": 2048,
                              "layer_types": ["sliding_attention", "full_attention"]}},
        tokens={"image_token_index": "<image_soft_token>", "boi_token_index": "<start_of_image>",
                "eoi_token_index": "<end_of_image>"}, vocab_fields=(("text_config", "vocab_size"),),
        template=_GEMMA3_TEMPLATE, processor=_gemma3_processor, extra_tokens=("<start_of_turn>", "<end_of_turn>")),
    "qwen3-vl-8b": VisionFamily(
        "qwen3_vl", QWEN3_VL_8B,
        # a 12-block tower of width 768 (DeepStack from blocks 3, 6, 9) on a 12-layer Qwen3 of width 768
        small={"vision_config": {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12,
                                 "out_hidden_size": 768, "deepstack_visual_indexes": [3, 6, 9]},
               "text_config": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                               "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
                               "max_position_embeddings": 2048, "rope_scaling": {"mrope_section": [12, 10, 10]}}},
        tiny={"vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                                "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
              "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "max_position_embeddings": 2048, "rope_scaling": {"mrope_section": [4, 2, 2]}}},
        tokens={"image_token_id": "<|image_pad|>", "vision_start_token_id": "<|vision_start|>",
                "vision_end_token_id": "<|vision_end|>", "video_token_id": "<|video_pad|>"},
        vocab_fields=(("text_config", "vocab_size"),), template=_QWEN_VL_TEMPLATE, processor=_qwen_vl_processor),
    "smolvlm-256m": VisionFamily(
        "idefics3", SMOLVLM_256M,
        # the released decoder (SmolLM2-135M's: 30 layers of width 576) and tower width on 256 px tiles (16 image
        # tokens each), pictures resized to 512 px: up to 2x2 tiles and the whole picture
        small={"vision_config": {"image_size": 256, "size": {"longest_edge": 512},
                                 "max_image_size": {"longest_edge": 256}}},
        # 32 px tiles in 8-pixel patches shuffled by 2 (4 image tokens a tile), pictures resized to 64 px
        tiny={"scale_factor": 2,
              "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
                                "size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}},
              "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "max_position_embeddings": 2048}},
        tokens={"image_token_id": "<image>"}, vocab_fields=(("vocab_size",), ("text_config", "vocab_size")),
        template=_SMOLVLM_TEMPLATE, processor=_smolvlm_processor, extra_tokens=_SMOLVLM_TOKENS),
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
    tok.add_special_tokens({"additional_special_tokens": [*fam.tokens.values(), *fam.extra_tokens]})
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
