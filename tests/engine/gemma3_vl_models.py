"""A tiny random-weight Gemma 3 vision-language model (HF Gemma3ForConditionalGeneration from Gemma3Config: a 2-layer
SigLIP vision tower on 32x32 images in 4-pixel patches, 8x8 patches average-pooled to mm_tokens_per_image 16; a
3-layer Gemma 3 text decoder, two sliding layers of a window shorter than an image's 16 soft tokens and one global,
over SmolLM2's tokenizer plus Gemma 3's image and turn tokens), saved as an HF folder with its Gemma3Processor
(Gemma3ImageProcessorPil, pan-and-scan off as HF's default; a chat template in Gemma 3's layout: each image part
renders <start_of_image>, which the processor expands to "\\n\\n<start_of_image>" + 16 <image_soft_token> +
"<end_of_image>\\n\\n"), the reference of tests/engine/vision/test_gemma3_vl.py (HF's greedy run:
llava_models.hf_greedy)."""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 16
#: The sliding layers' window (tokens): shorter than an image's run of soft tokens.
WINDOW = 12
#: Gemma 3's chat template (google/gemma-3-4b-it's layout: "<start_of_turn>user\n" + parts + "<end_of_turn>\n",
#: an image part as <start_of_image>, the text trimmed; the generation prompt "<start_of_turn>model\n").
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else "
    "message['role']) + '\n' }}{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
#: Gemma 3's tokenizer's named image tokens (its tokenizer_config's boi_token, eoi_token, image_token).
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def gemma3_tokenizer(folder: Path, hf_tok):
    """`hf_tok` (SmolLM2's, a fresh copy) with Gemma 3's image and turn tokens, saved in `folder` and loaded back
    with the named image tokens Gemma3Processor reads (tokenizer.boi_token, eoi_token, image_token and their ids)."""
    import transformers

    hf_tok.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS.values(), "<start_of_turn>",
                                                            "<end_of_turn>"]})
    hf_tok.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens=IMAGE_TOKENS)


def build_gemma3_vl(folder: Path, hf_tok, seed: int = 11):
    """The tiny model (fp32, eager attention) saved in `folder` with its processor; returns the HF model."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = gemma3_tokenizer(folder, hf_tok)
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=2048,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                                             vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                                    boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                                    image_token_index=tok.image_token_id)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # SigLIP's LayerNorms
            elif "norm" in name:  # Gemma's RMSNorms multiply by 1 + weight
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:  # scaled by sqrt(hidden): keep the layers audible
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=CHAT_TEMPLATE,
                                             image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(folder)
    return model


def hf_causal_greedy(model, processor, prompt: dict, max_tokens: int) -> list[int]:
    """HF's greedy output ids for `{"prompt", "images"}` with every token attending causally: token_type_ids
    dropped, so HF builds its text-only mask (what the image tokens would see without Gemma 3's bidirectional
    mask)."""
    from llava_models import decoded

    chat = [{"role": "user", "content": [{"type": "image"}] * len(prompt["images"]) +
             [{"type": "text", "text": prompt["prompt"]}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[decoded(i) for i in prompt["images"]], return_tensors="pt")
    inputs.pop("token_type_ids")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
