"""A tiny random-weight Qwen2.5-VL (HF Qwen2_5_VLForConditionalGeneration from Qwen2_5_VLConfig: a 3-block vision
tower of 4-pixel patches, 2x2 merged, windows of 2x2 merged tokens with block 1 full attention; a 2-layer Qwen2 text
model with M-RoPE sections [2, 3, 3]) over SmolLM2's tokenizer plus Qwen's vision tokens, saved as an HF folder
with its processor (Qwen2VLImageProcessorPil: dynamic resolution between 8x8 and 24x24 patches' worth of pixels;
a Qwen-style chat template); and HF's greedy run of an image prompt, the reference of tests/engine/vision. The
Pillow pictures and the HF reference run are tests/engine/llava_models.py's. With family "qwen3_vl" a tiny Qwen3-VL
(Qwen3VLForConditionalGeneration: a 3-block LayerNorm tower with a 10x10 learned position grid and DeepStack from
blocks 0 and 2; a 3-layer Qwen3 text model with interleaved M-RoPE sections [4, 2, 2])."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from llava_models import draw_weights

PATCH, MERGE = 4, 2
MIN_PIXELS, MAX_PIXELS = (8 * PATCH) ** 2, (24 * PATCH) ** 2
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: Qwen2-VL's chat layout (an image is <|vision_start|><|image_pad|><|vision_end|>), written for these tests.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_qwen_vl(folder: Path, hf_tok, seed: int = 5, family: str = "qwen2_5_vl"):
    """The tiny Qwen2.5-VL, or with family "qwen2_vl" a tiny Qwen2-VL (a LayerNorm tower with a quick-GELU MLP and
    full attention in its 2 blocks), or with "qwen3_vl" the tiny Qwen3-VL, fp32, saved in `folder` with its
    processor; returns the HF model. `hf_tok` (SmolLM2's, a fresh copy: it gains the vision tokens) is its tokenizer.
    Weights: llava_models.draw_weights."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = hf_tok
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = dict(zip(VISION_TOKENS, tok.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    common = dict(num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    if family == "qwen3_vl":  # Qwen3's q/k norms and head_dim; interleaved M-RoPE; DeepStack
        config_class, model_class = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        text |= dict(num_hidden_layers=3, head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True})
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_position_embeddings=100,
                      deepstack_visual_indexes=[0, 2], **common)
        processor_class = "Qwen3VLProcessor"
    elif family == "qwen2_vl":
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, hidden_act="quick_gelu", **common)
        processor_class = "Qwen2VLProcessor"
    else:
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, window_size=2 * PATCH * MERGE,
                      out_hidden_size=64, fullatt_block_indexes=[1], **common)
        processor_class = "Qwen2_5_VLProcessor"
    cfg = config_class(
        vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(cfg).eval()
    draw_weights(model)
    model.save_pretrained(folder)
    norm = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if family == "qwen3_vl" else {}  # Qwen3-VL's
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                                               patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE, **norm)
    # The processor's parts as Qwen2.5-VL's hub folders hold them (its video processor needs torchvision, which
    # tokenmill does not install: engine.multimodal.processor builds the processor without it).
    image_processor.save_pretrained(folder)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(config | {"processor_class": processor_class}))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return model
