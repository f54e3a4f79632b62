"""A tiny random-weight LLaVA-NeXT (HF LlavaNextForConditionalGeneration from LlavaNextConfig: a 3-layer CLIP tower on
28x28 tiles in 7-pixel patches, so 16 features a tile; anyres grid pinpoints of 1x2, 2x1, 2x2, 3x1 and 1x3 tiles; a
2-layer Llama over SmolLM2's tokenizer plus "<image>"), saved as an HF folder with its LlavaNextProcessor (the Pillow
LlavaNextImageProcessor, LLaVA's chat template): the reference of tests/engine/vision/test_llava_next.py (HF's greedy
run: llava_models.hf_greedy)."""

from __future__ import annotations

from pathlib import Path

from llava_models import CHAT_TEMPLATE, randomized, tiny_clip, tiny_llama

TILE, PATCH = 28, 7
BASE_TOKENS = (TILE // PATCH) ** 2
PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]


def build_llava_next(folder: Path, hf_tok, seed: int = 7):
    """The tiny LLaVA-NeXT (fp32, eager attention) saved in `folder` with its processor; returns the HF model.
    `hf_tok` (SmolLM2's, a fresh copy) gains the image token."""
    import transformers
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = hf_tok
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    cfg = transformers.LlavaNextConfig(vision_config=tiny_clip(TILE, PATCH), text_config=tiny_llama(len(tok)),
                                       image_token_index=image_id,
                                       image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
                                       vision_feature_select_strategy="default")
    model = randomized(transformers.LlavaNextForConditionalGeneration, cfg, seed)
    model.save_pretrained(folder)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
                                        image_grid_pinpoints=PINPOINTS)
    processor = transformers.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=PATCH,
                                                vision_feature_select_strategy="default",
                                                num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return model
