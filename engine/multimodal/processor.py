"""An image prompt into the token ids it runs as and its images' MultiModalItems, through the model's own Hugging Face
processor (AutoProcessor of the model folder: LlavaProcessor over CLIPImageProcessor's Pillow backend; never
hand-written resizing or normalising): the chat template (the tokenizer's, else the processor's) renders the
messages with one image token per image, the image processor makes pixel_values, and each image token is replaced by
the token ids of the processor's own replacement text (`replace_image_token`: LLaVA's image token repeated once per
feature row), exactly as the processor's `__call__` expands its text. As vLLM's multimodal processing, the text and
the images are processed apart and merged by the placeholders' offsets (vLLM's design; no code of it).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from engine.multimodal.inputs import MultiModalItem, image_messages, load_image
from engine.vision_config import QwenVisionConfig, VisionConfig

if TYPE_CHECKING:
    import numpy as np
    import torch

    from engine.text.tokenizer import Tokenizer


def mm_hash(pixel_values: torch.Tensor, grid_thw: tuple[int, ...] | None = None) -> str:
    """Content hash (BLAKE2b-128, hex) of an image's pixel_values [channels, H, W] (or patches and their grid_thw):
    its shape, dtype, grid and bytes."""
    array = pixel_values.detach().cpu().contiguous().numpy()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{array.dtype}{array.shape}{grid_thw or ''}".encode())
    h.update(array.tobytes())
    return h.hexdigest()


def image_only_processor(path: str) -> Any:
    """The HF processor of the folder at `path` (its processor_class, from processor_config.json or
    preprocessor_config.json) built without its video processor, whose torchvision backend tokenmill does not install
    (transformers' AutoProcessor raises ImportError for Qwen2-VL's): the Pillow image processor, the tokenizer and the
    chat template (chat_template.jinja or chat_template.json), with the processor class's own text expansion.
    Raises ValueError when no processor class is named, ImportError when the class needs more than its video half."""
    import json
    from pathlib import Path

    import transformers

    names = [json.loads(f.read_text()).get("processor_class") for f in
             (Path(path, "processor_config.json"), Path(path, "preprocessor_config.json")) if f.is_file()]
    name = next((n for n in names if n), None)
    if name is None or not hasattr(transformers, name):
        raise ValueError(f"{path} names no transformers processor class ({names})")
    base = getattr(transformers, name)

    class ImageOnly(base):  # the class's check of a None video processor looks up the torchvision-only mapping
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    template = None  # the processor's chat template (chat_template.jinja, or the older chat_template.json)
    if Path(path, "chat_template.jinja").is_file():
        template = Path(path, "chat_template.jinja").read_text()
    elif Path(path, "chat_template.json").is_file():
        template = json.loads(Path(path, "chat_template.json").read_text()).get("chat_template")
    return ImageOnly(image_processor=transformers.AutoImageProcessor.from_pretrained(path),
                     tokenizer=transformers.AutoTokenizer.from_pretrained(path), video_processor=None,
                     chat_template=template)


class ImageProcessor:
    """The model's HF processor, for prompts with images.

    Args:
        hf_processor: the transformers processor of the model folder (its `image_processor`, `image_token`,
            `replace_image_token`, and maybe `chat_template`).
        vision: the model's VisionConfig or QwenVisionConfig (its image token id and the feature rows of an image,
            checked against the processor's expansion).
    Raises ValueError when the processor's image token is not the model's.
    """

    def __init__(self, hf_processor: Any, vision: VisionConfig | QwenVisionConfig) -> None:
        self.hf = hf_processor
        self.vision = vision
        self.image_token: str = hf_processor.image_token
        token_id = getattr(hf_processor, "image_token_id", None)
        if token_id != vision.image_token_id:
            raise ValueError(f"the processor's image token {self.image_token!r} is id {token_id}; config.json says "
                             f"{vision.image_token_id}")
        self.chat_template: str | None = getattr(hf_processor, "chat_template", None)

    @classmethod
    def from_model_path(cls, path: str, vision: VisionConfig | QwenVisionConfig) -> ImageProcessor:
        """The processor of the model folder at `path` (AutoProcessor: processor_config.json or
        preprocessor_config.json; Pillow backends, no torchvision). Raises ValueError when the folder has none
        (a vision-language model's images need its own processor) or as __init__."""
        from transformers import AutoProcessor

        try:
            try:
                hf = AutoProcessor.from_pretrained(path)
            except ImportError:  # a video processor that needs torchvision (Qwen2-VL's): the image half alone
                hf = image_only_processor(path)
        except (OSError, ValueError, KeyError, ImportError) as e:
            raise ValueError(f"{path} has no image processor transformers can load ({type(e).__name__}: {e}); a "
                             "vision-language model folder needs its processor_config.json / "
                             "preprocessor_config.json") from e
        if not hasattr(hf, "image_processor") or not hasattr(hf, "image_token"):
            raise ValueError(f"{path}: AutoProcessor gives a {type(hf).__name__}, not a processor with images")
        return cls(hf, vision)

    def process(self, prompt: object, tokenizer: Tokenizer, use_chat_template: bool = True,
                allow_special_tokens: bool = False) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """(token ids with every image's placeholders expanded, the images' MultiModalItems in prompt order) of an
        image prompt (engine.multimodal's forms). User text stays text (engine.text.tokenizer): an image token
        spelt in a message is plain characters; in a raw prompt (use_chat_template False) its spellings are the
        image placeholders. Raises ValueError (the request's error output) for a malformed prompt, an image
        Pillow cannot read, placeholders that do not match the images in number, or a processor whose expansion
        differs from the model's feature rows."""
        text, raw_images, chat = image_messages(prompt)
        images = [load_image(img) for img in raw_images]
        if chat:
            ids = tokenizer.apply_chat_template(text, allow_special_tokens=allow_special_tokens)
        elif use_chat_template:
            parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
            ids = tokenizer.apply_chat_template([{"role": "user", "content": parts}],
                                                allow_special_tokens=allow_special_tokens)
        else:  # raw: the image token's spellings are placeholders, so the text is encoded with its added tokens
            spelt = [t for t in self.hf.tokenizer.get_added_vocab() if t != self.image_token and t in text]
            if spelt and not allow_special_tokens:
                raise ValueError(f"the raw image prompt spells control tokens {spelt[:3]} besides "
                                 f"{self.image_token!r}; use the chat form, or allow_special_tokens to mean them")
            ids = tokenizer.encode(text, allow_special_tokens=True)
        return self.expand(ids, images)

    def expand(self, ids: list[int], images: list[Any]) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Replace the i-th image token of `ids` by the processor's replacement for images[i] (decoded Pillow
        images) and make their items. Raises ValueError as `process`."""
        token = self.vision.image_token_id
        at = [i for i, t in enumerate(ids) if t == token]
        if len(at) != len(images):
            raise ValueError(f"the prompt has {len(at)} image placeholders ({self.image_token!r}) but {len(images)} "
                             "images; give one image per placeholder")
        if not images:
            return ids, ()
        processed = self.hf.image_processor(images, return_tensors="pt")
        pixel_values = processed["pixel_values"]
        grids = processed.get("image_grid_thw")  # dynamic resolution: every image's patches, concatenated
        if grids is not None:
            grids = [tuple(int(n) for n in g) for g in grids.tolist()]
            pixel_values = pixel_values.split([t * h * w for t, h, w in grids])
        out: list[int] = []
        items = []
        prev = 0
        for i, pos in enumerate(at):
            out += ids[prev:pos]
            replacement = self.hf.tokenizer.encode(self.hf.replace_image_token(processed, image_idx=i),
                                                   add_special_tokens=False)
            rows = [j for j, t in enumerate(replacement) if t == token]
            if not rows or rows != list(range(rows[0], rows[0] + len(rows))):
                raise ValueError("the processor's image placeholders are not one contiguous run of image tokens; "
                                 "tokenmill does not run that layout")
            grid = None if grids is None else grids[i]
            want = self.vision.tokens_per_image if grid is None else self.vision.tokens_of(grid)
            if len(rows) != want:
                raise ValueError(f"the processor expands an image into {len(rows)} placeholder tokens but the model "
                                 f"gives {want} feature rows for it (check processor_config.json's patch_size, "
                                 "merge_size, num_additional_image_tokens and vision_feature_select_strategy)")
            pv = pixel_values[i].float().contiguous()
            items.append(MultiModalItem(pv, len(out) + rows[0], len(rows), mm_hash(pv, grid), grid))
            out += replacement
            prev = pos + 1
        out += ids[prev:]
        return out, tuple(items)


    def mrope_positions(self, num_tokens: int, items: tuple[MultiModalItem, ...]) -> np.ndarray | None:
        """The M-RoPE positions int64 [3, num_tokens] of a prompt with images `items` (engine.multimodal.mrope) for a
        model with M-RoPE (Qwen2-VL: a QwenVisionConfig); None for another model or a prompt without images (plain
        RoPE positions are its M-RoPE ones). Raises ValueError as mrope.prompt_positions."""
        if not items or not isinstance(self.vision, QwenVisionConfig):
            return None
        from engine.multimodal.mrope import prompt_positions

        return prompt_positions(num_tokens, items, self.vision.spatial_merge_size)
