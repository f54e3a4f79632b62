"""Tiny random-weight Idefics3 and SmolVLM models (HF Idefics3ForConditionalGeneration / SmolVLMForConditionalGeneration
from their config classes: a 2-layer SigLIP encoder on 32x32 tiles in 8-pixel patches, a pixel shuffle by 2, so 4
image tokens per tile; a 2-layer Llama over SmolLM2's tokenizer plus the processors' special tokens), saved as HF
folders with their processors (Idefics3Processor over Idefics3's or SmolVLM's Pillow image processor, which tile an
image whose longest edge they resize to 64 or 96 pixels into up to 2x2 or 3x3 tiles plus the global image), the
references of tests/engine/vision/test_idefics3.py (HF's greedy run: llava_models.hf_greedy)."""

from __future__ import annotations

from pathlib import Path

from llava_models import randomized, tiny_llama

TILE, PATCH, SCALE = 32, 8, 2
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // SCALE ** 2
#: SmolVLM's chat template ("<|im_start|>User:<image>text<end_of_utterance>\nAssistant:"), images where they are.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
#: The special tokens of Idefics3's and SmolVLM's tokenizers that image prompts use.
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


def build_idefics3(folder: Path, hf_tok, family: str = "idefics3", longest_edge: int = 64, seed: int = 5):
    """The tiny `family` ("idefics3" or "smolvlm") model (fp32, eager attention) saved in `folder` with its processor
    (images resized to `longest_edge`, tiles of 32); returns the HF model. `hf_tok` (SmolLM2's, a fresh copy) gains
    the special tokens."""
    import transformers

    tok = hf_tok
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    image_id = tok.convert_tokens_to_ids("<image>")
    text = tiny_llama(len(tok), 4096)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
                  patch_size=PATCH)
    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as Images

        cfg = transformers.Idefics3Config(vision_config=transformers.Idefics3VisionConfig(**vision),
                                          text_config=text, image_token_id=image_id, scale_factor=SCALE)
        model_class, processor_class = transformers.Idefics3ForConditionalGeneration, transformers.Idefics3Processor
    else:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as Images

        cfg = transformers.SmolVLMConfig(vision_config=transformers.SmolVLMVisionConfig(**vision), text_config=text,
                                         image_token_id=image_id, scale_factor=SCALE)
        # NOTE: SmolVLMProcessor cannot be built here without its video processor (torchvision, not installed);
        # Idefics3Processor writes the same image layout (SmolVLM's get_image_prompt_string) over SmolVLM's own image
        # processor. A folder naming SmolVLMProcessor, as the hub's do: tests/engine/vision/test_smolvlm_folder.py.
        model_class, processor_class = transformers.SmolVLMForConditionalGeneration, transformers.Idefics3Processor
    model = randomized(model_class, cfg, seed)
    model.save_pretrained(folder)
    images = Images(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": TILE})
    processor = processor_class(image_processor=images, tokenizer=tok, image_seq_len=TOKENS_PER_TILE,
                                chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return model
