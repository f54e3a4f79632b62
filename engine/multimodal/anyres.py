"""LLaVA-NeXT's "anyres" geometry (Liu et al., "LLaVA-NeXT: Improved reasoning, OCR, and world knowledge", 2024): which
of the model's grid pinpoints an image is resized into, the rows x cols tiles that makes, and which rows or columns of
the tiles' feature grid are padding (the image letterboxed into the pinpoint) and so dropped before the
image_newline column is appended. The model (engine.model.llava_next) cuts its features with these numbers and the
processor (engine.multimodal.processor) checks the HF processor's placeholder count against `anyres_tokens`, so the
two never disagree silently. Integer and float arithmetic as HF's select_best_resolution, unpad_image and
LlavaNextModel.pack_image_features do it (their results, not their code). No torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine.vision_config import VisionConfig


class AnyresLayout(NamedTuple):
    """The feature layout of one image: `rows` x `cols` tiles of side x side features each; of their feature grid
    [rows * side, cols * side], rows [top, bottom) and columns [left, right) are the image (the rest padding)."""

    rows: int
    cols: int
    top: int
    bottom: int
    left: int
    right: int

    @property
    def height(self) -> int:
        return self.bottom - self.top

    @property
    def width(self) -> int:
        return self.right - self.left


def best_resolution(image_size: tuple[int, int], pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (height, width) of `pinpoints` that an image of `image_size` (height, width) fits best: the most of its
    pixels kept when scaled to fit inside (at most its own count), then the least area wasted. Raises ValueError for
    no pinpoints or an empty image."""
    height, width = image_size
    if not pinpoints or height < 1 or width < 1:
        raise ValueError(f"anyres needs grid pinpoints and a non-empty image; got {list(pinpoints)}, {image_size}")
    best, best_key = pinpoints[0], (-1, 0)
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        key = (kept, -(w * h - kept))
        if key > best_key:
            best, best_key = (h, w), key
    return best


def anyres_layout(v: VisionConfig, image_size: tuple[int, int]) -> AnyresLayout:
    """The layout of an image of original `image_size` (height, width) for vision config `v` (its
    image_grid_pinpoints, tiles of image_size pixels and side = image_size / patch_size features). Raises ValueError
    as best_resolution."""
    h, w = best_resolution(image_size, v.image_grid_pinpoints)
    rows, cols = h // v.image_size, w // v.image_size
    side = v.image_size // v.patch_size
    grid_h, grid_w = rows * side, cols * side
    height, width = image_size
    if width / height > grid_w / grid_h:  # wider than the grid: padding above and below
        kept = int(round(height * (grid_w / width), 7))
        pad = (grid_h - kept) // 2
        return AnyresLayout(rows, cols, pad, grid_h - pad, 0, grid_w)
    kept = int(round(width * (grid_h / height), 7))
    pad = (grid_w - kept) // 2
    return AnyresLayout(rows, cols, 0, grid_h, pad, grid_w - pad)


def anyres_tokens(v: VisionConfig, image_size: tuple[int, int]) -> int:
    """Feature rows (= placeholder tokens) of an image of original `image_size` (height, width): the base image's
    tokens_per_image, then each kept row of the tiles' feature grid followed by one image_newline row."""
    layout = anyres_layout(v, image_size)
    return v.tokens_per_image + layout.height * (layout.width + 1)
