"""LLaVA-NeXT (HF LlavaNextForConditionalGeneration, LLaVA-1.6): LLaVA's CLIP tower, projector and causal decoder
(engine.model.llava) with "anyres" images: the image processor (LlavaNextImageProcessor) resizes an image into the
best of the model's image_grid_pinpoints, cuts that into rows x cols tiles of the tower's image size and adds the
whole image resized as a base tile; every tile runs through the tower and the projector, and the image's features
are the base tile's rows, then the tiles' feature grid (rows * side x cols * side) with the letterbox padding rows
or columns dropped ("unpadding"), each of its rows followed by the learned `image_newline` vector (HF's
pack_image_features, "spatial_unpad"). The image's placeholder count therefore depends on its original size, which
the processor reports (image_sizes) and engine.multimodal.processor checks against engine.multimodal.anyres.

Sources: Liu et al., "LLaVA-NeXT: Improved reasoning, OCR, and world knowledge" (2024); "Improved Baselines with
Visual Instruction Tuning" (LLaVA-1.5, 2023); HF transformers' modeling_llava_next.py.

An image is one engine.multimodal MultiModalItem: pixel_values [tiles, channels, S, S] (base first) and its
image_size (height, width), one contiguous run of placeholders. Parameter names: llava's plus `image_newline`
(checkpoint "image_newline" or "model.image_newline").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.model.llava import LlavaVLM
from engine.multimodal.anyres import anyres_layout
from engine.vision_config import VisionConfig


class LlavaNextVLM(LlavaVLM):
    """The LLaVA-NeXT model: LlavaVLM plus `image_newline` [hidden].

    encode_images: pixel_values [N, tiles, channels, S, S] (N images of as many tiles, base tile first) and their
    image_sizes -> N feature tensors [tokens_i, hidden] in the model's dtype (engine.multimodal.anyres.anyres_tokens
    rows each). Raises ValueError for a missing image size or a tile count that is not its layout's."""

    def add_vision(self, v: VisionConfig, text_width: int) -> None:
        super().add_vision(v, text_width)
        self.image_newline = nn.Parameter(torch.empty(text_width))

    def encode_images(self, pixel_values: torch.Tensor, *,
                      image_sizes: Sequence[tuple[int, int] | None] | None = None) -> list[torch.Tensor]:
        """The features of each image (HF LlavaNextModel.get_image_features then pack_image_features)."""
        if pixel_values.dim() != 5 or image_sizes is None or len(image_sizes) != pixel_values.shape[0]:
            raise ValueError("llava_next takes pixel_values [images, tiles, channels, H, W] with one image size "
                             "(height, width) per image")
        n, tiles = pixel_values.shape[:2]
        feats = super().encode_images(pixel_values.flatten(0, 1)).view(n, tiles, -1, self.config.hidden_size)
        return [self._pack(f, size) for f, size in zip(feats, image_sizes, strict=True)]

    def _pack(self, feats: torch.Tensor, image_size: tuple[int, int] | None) -> torch.Tensor:
        """One image's tile features [tiles, side * side, hidden] -> [tokens, hidden]: the base tile's rows, then
        the unpadded grid row by row, each row ended by image_newline."""
        v = self.config.vision
        if image_size is None:
            raise ValueError("a llava_next image needs its original size (height, width)")
        layout = anyres_layout(v, image_size)
        side = v.image_size // v.patch_size
        if feats.shape[0] != 1 + layout.rows * layout.cols:
            raise ValueError(f"an image of size {image_size} has {feats.shape[0]} tiles; its layout takes "
                             f"1 + {layout.rows} x {layout.cols}")
        d = feats.shape[-1]
        grid = feats[1:].view(layout.rows, layout.cols, side, side, d).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(layout.rows * side, layout.cols * side, d)[layout.top:layout.bottom,
                                                                        layout.left:layout.right]
        newline = self.image_newline.to(grid.dtype).expand(layout.height, 1, d)
        return torch.cat([feats[0], torch.cat([grid, newline], dim=1).reshape(-1, d)])
