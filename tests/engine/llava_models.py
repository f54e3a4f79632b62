"""A tiny random-weight LLaVA-1.5 (HF LlavaForConditionalGeneration from LlavaConfig: a 3-layer CLIP vision tower on
56x56 images in 14-pixel patches, 16 image tokens per image, a 2-layer Llama over SmolLM2's tokenizer plus an
"<image>" token), saved as an HF folder with its LlavaProcessor (a CLIPImageProcessor, the tokenizer, LLaVA-1.5's
chat template); pictures drawn with Pillow in several sizes and modes; and HF's greedy run of an image prompt with
the model's own processor, the reference of tests/engine/vision."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch
from PIL import Image, ImageDraw

IMAGE_SIZE, PATCH = 56, 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2
#: Tokens each vision test generates (greedy, ignore_eos).
MAX_TOKENS = 8
#: LLaVA-1.5's chat template (llava-hf/llava-1.5-7b-hf: "USER: <image>\n<text> ASSISTANT:"), images before text.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def build_llava(folder: Path, hf_tok, seed: int = 3):
    """The tiny LLaVA (fp32, eager attention) saved in `folder` with its processor; returns the HF model. `hf_tok`
    (SmolLM2's, a fresh copy: it gains the image token) is its tokenizer. Weights drawn large enough that the image
    changes the greedy text (norms around 1, the rest N(0, 0.15))."""
    import transformers

    tok = hf_tok
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    cfg = transformers.LlavaConfig(vision_config=tiny_clip(IMAGE_SIZE, PATCH), text_config=tiny_llama(len(tok)),
                                   image_token_id=image_id,
                                   vision_feature_layer=-2, vision_feature_select_strategy="default")
    model = randomized(transformers.LlavaForConditionalGeneration, cfg, seed)
    model.save_pretrained(folder)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                            chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return model


def tiny_llama(vocab_size: int, max_positions: int = 2048):
    """The text model of the tiny vision-language models: a 2-layer Llama of width 64 (GQA 4/2), untied."""
    import transformers

    return transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=max_positions, rms_norm_eps=1e-5, bos_token_id=1,
                                    eos_token_id=2, tie_word_embeddings=False)


def tiny_clip(image_size: int, patch: int):
    """A 3-layer CLIP vision tower of width 32 on `image_size` images in `patch`-pixel patches."""
    import transformers

    return transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, image_size=image_size, patch_size=patch)


def randomized(model_class, cfg, seed: int):
    """`model_class(cfg)` (eval, eager attention) with weights drawn large enough that the image changes the greedy
    text: norm weights 1 + N(0, 0.3), the rest N(0, 0.15), from `seed`."""
    torch.manual_seed(seed)
    model = model_class(cfg).eval()
    model.config._attn_implementation = "eager"
    draw_weights(model)
    return model


def draw_weights(model: torch.nn.Module) -> None:
    """Redraw a tiny model's weights (torch's global generator) large enough that an image changes the greedy
    text: norm weights around 1 (1 + N(0, 0.3)), every other parameter N(0, 0.15)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)


def picture(kind: str, size: tuple[int, int], seed: int) -> Image.Image:
    """A drawn picture (background, ellipse, rectangle, lines, a word) in mode `kind` ("RGB", "RGBA", "L", "CMYK",
    "P") of `size` (width, height); `seed` picks the colours and places."""
    g = torch.Generator().manual_seed(seed)

    def r(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=g))

    w, h = size
    img = Image.new("RGB", size, (r(256), r(256), r(256)))
    d = ImageDraw.Draw(img)
    d.ellipse([r(w // 2), r(h // 2), w // 2 + r(w // 2), h // 2 + r(h // 2)], fill=(r(256), r(256), r(256)))
    d.rectangle([r(w // 3), r(h // 3), w // 3 + r(w // 2), h // 3 + r(h // 2)], outline=(r(256), 0, r(256)), width=3)
    for _ in range(3):
        d.line([r(w), r(h), r(w), r(h)], fill=(r(256), r(256), 0), width=2)
    d.text((2, 2), "tokenmill"[: 3 + r(6)], fill=(255 - r(64), 255, 255))
    if kind == "RGBA":
        img = img.convert("RGBA")
        img.putalpha(Image.linear_gradient("L").resize(size))
    elif kind in ("L", "CMYK", "P"):
        img = img.convert(kind)
    return img


def encoded(img: Image.Image, fmt: str) -> bytes:
    """`img` encoded as `fmt` (PNG, JPEG: a CMYK image stays a CMYK JPEG)."""
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def decoded(image: object) -> Image.Image:
    """The Pillow image HF's processor is given for one of our image forms (bytes, data URL, PIL)."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, str):
        image = base64.b64decode(image.partition(",")[2])
    return Image.open(io.BytesIO(image))


def hf_greedy(model, processor, messages: list[dict] | None, images: list, max_tokens: int,
              raw: str | None = None, **processor_kwargs) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy output ids) of HF transformers for chat `messages` (rendered by the processor's chat
    template) or the `raw` text, with `images` through the model's own processor (given `processor_kwargs`, as
    its __call__ takes them: size=..., ...)."""
    text = raw if raw is not None else processor.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=False)
    inputs = processor(text=text, images=[decoded(i) for i in images] or None, return_tensors="pt",
                       **processor_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()
