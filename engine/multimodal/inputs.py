"""The multimodal data of a request (MultiModalItem) and the image prompt forms (engine.multimodal's docstring):
which prompts carry images, their chat messages in the form chat templates take, and the images decoded by Pillow.
No torch at module level: engine.core.request holds items and the core is plain Python."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL import Image

#: Content part types of a chat message that are images (OpenAI's image_url, HF's image).
IMAGE_PARTS = ("image", "image_url")


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    """One image of a request.

    Attributes:
        pixel_values: float32 [channels, H, W], the model's own image processor's output for the image (or tile:
            Idefics3); LLaVA-NeXT's anyres tiles [tiles, channels, H, W]; for a dynamic-resolution model (Qwen2-VL) its
            patches, float32 [t * h * w, channels * frames * patch^2].
        offset: index in the prompt's token ids of the image's first placeholder token.
        length: placeholder tokens of the image (= rows of its encoder features), contiguous from `offset`.
        mm_hash: content hash of pixel_values (hex): equal only for equal encoder inputs (the encoder cache's key,
            and the part of a prefix-cache block's key that tells images with the same placeholder tokens apart).
        grid_thw: a dynamic-resolution model's patch grid (frames, rows, columns: the processor's image_grid_thw);
            None for a fixed-size image.
        image_size: the original image's (height, width) where the features depend on it (LLaVA-NeXT's unpadding),
            else None.
    """

    pixel_values: torch.Tensor
    offset: int
    length: int
    mm_hash: str
    grid_thw: tuple[int, int, int] | None = None
    image_size: tuple[int, int] | None = None

    @property
    def end(self) -> int:
        """Index one past the image's last placeholder token."""
        return self.offset + self.length


def is_image_prompt(prompt: object) -> bool:
    """Whether `prompt` is one of the image forms: a dict with "images", "prompt" or "messages", or a messages list
    with an image content part."""
    if isinstance(prompt, dict):  # {"role", "content"} alone is a chat message, not an image prompt (a text error)
        return any(key in prompt for key in ("images", "prompt", "messages"))
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in m["content"]) for m in prompt)


def load_image(obj: object) -> Image.Image:
    """A decoded Pillow image of `obj`: a PIL.Image.Image (as it is), encoded bytes, a base64 `data:` URL, or a
    {"bytes": ...} dict (HF datasets' Image feature). Raises ValueError (one line) for bytes Pillow cannot decode,
    a malformed data URL, or another type (a path or http/s3 URL: the pipeline reads those)."""
    return _open_image(obj, decode=True)


def image_size(obj: object) -> tuple[int, int]:
    """The (height, width) in pixels of an image in load_image's forms, read from its header without decoding its
    pixels (Pillow opens lazily). Raises ValueError as load_image (bytes Pillow cannot identify, ...)."""
    width, height = _open_image(obj, decode=False).size
    return height, width


def _open_image(obj: object, decode: bool) -> Image.Image:
    """The Pillow image of `obj` (load_image's forms), its pixels decoded when `decode`, else its header alone."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(obj, Image.Image):
        return obj
    if isinstance(obj, dict) and obj.get("bytes") is not None:
        obj = obj["bytes"]
    if isinstance(obj, str):
        if not obj.startswith("data:"):
            raise ValueError(f"image {obj[:60]!r} is a path or URL; the engine takes images as bytes, data: URLs or "
                             "PIL images (the pipeline reads paths and URLs)")
        head, _, data = obj.partition(",")
        if not head.endswith(";base64"):
            raise ValueError(f"image data URL {head!r} is not base64 (data:image/png;base64,...)")
        try:
            obj = base64.b64decode(data, validate=True)
        except binascii.Error as e:
            raise ValueError(f"image data URL holds invalid base64 ({e})") from e
    if not isinstance(obj, bytes | bytearray | memoryview):
        raise ValueError(f"an image must be a PIL image, bytes, a data: URL or {{'bytes': ...}}, not "
                         f"{type(obj).__name__}")
    try:
        image = Image.open(io.BytesIO(bytes(obj)))
        if decode:
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"the image bytes are not an image Pillow can read ({type(e).__name__}: {e})") from e
    return image


def _part_image(part: dict[str, Any]) -> object | None:
    """The image a content part carries itself (image_url's URL, an image part's "image" or "url"), or None for a
    bare {"type": "image"}, which takes the next of the prompt's `images`."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ValueError(f"an image_url part needs {{'url': ...}}, got {part!r}")
        return url
    return part.get("image", part.get("url"))


def image_messages(prompt: object) -> tuple[str | list[dict[str, Any]], list[object], bool]:
    """(text or chat messages, the images in prompt order, whether the text is a chat) of an image prompt
    (is_image_prompt). Messages come back with each image part as {"type": "image"} (what chat templates
    render), text parts as {"type": "text", "text": ...}; a string content is kept. Raises ValueError for a
    malformed prompt, or images given beside the messages that their image parts do not take."""
    if isinstance(prompt, list):
        prompt = {"messages": prompt}
    if not isinstance(prompt, dict):
        raise ValueError(f"an image prompt is a dict or a messages list, not {type(prompt).__name__}")
    unknown = sorted(set(prompt) - {"prompt", "messages", "images"})
    if unknown or ("prompt" in prompt) == ("messages" in prompt):
        raise ValueError(f"an image prompt is {{'prompt': text, 'images': [...]}} or {{'messages': [...], "
                         f"'images': [...]}}; got keys {sorted(prompt)}")
    given = prompt.get("images") or []
    if not isinstance(given, list | tuple):
        raise ValueError(f"'images' must be a list, got {type(given).__name__}")
    given = list(given)
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the image prompt's 'prompt' must be non-empty text")
        return text, given, False
    messages = prompt["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} messages")
    out, images, taken = [], [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be {{'role': ..., 'content': ...}}, got {m!r}")
        content = m["content"]
        if isinstance(content, str):
            out.append(dict(m))
            continue
        if not isinstance(content, list):
            raise ValueError(f"message {i} content must be text or a list of parts, got {type(content).__name__}")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in IMAGE_PARTS:
                own = _part_image(part)
                if own is None:
                    if taken >= len(given):
                        raise ValueError(f"the messages have more image parts than the {len(given)} images given; "
                                         "give one image per {'type': 'image'} part")
                    own, taken = given[taken], taken + 1
                images.append(own)
                parts.append({"type": "image"})
            else:
                raise ValueError(f"message {i} has a content part {part!r}; parts are text, image or image_url")
        out.append({**m, "content": parts})
    if taken < len(given):
        raise ValueError(f"{len(given)} images were given but the messages' image parts take {taken}; add a "
                         "{'type': 'image'} part for each")
    return out, images, True
