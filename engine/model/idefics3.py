"""Idefics3 and SmolVLM (HF Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration: one architecture, two
processors): a SigLIP vision encoder (engine.model.siglip_vision), a connector (a pixel shuffle by `scale_factor`,
then one bias-free Linear "modality_projection.proj" into the text width), and a Llama causal decoder (the generic
engine.model.decoder).

Sources: Laurençon et al., "Building and better understanding vision-language models: insights and future
directions" (Idefics3, 2024); Marafioti et al., "SmolVLM: Redefining small and efficient multimodal models" (2025);
Zhai et al., SigLIP (2023); HF transformers' modeling_idefics3.py and modeling_smolvlm.py.

An image reaches the model as tiles: its own image processor (Idefics3ImageProcessor / SmolVLMImageProcessor) cuts
it into rows x cols tiles plus a global view, and its processor writes each tile's run of image tokens between
<fake_token_around_image> and a <row_r_col_c> (or <global-img>) tag. Each tile is one engine.multimodal
MultiModalItem (its own run of placeholders, encoder cache entry and hash); `encode_images` maps a batch of tiles to
their feature rows, which the model runner merges at the tiles' placeholders (engine.worker.mm_embeds), as HF's
inputs_merger fills the image tokens in order. Parameter names: the decoder's (layers.*, embed_tokens, norm,
lm_head), `vision_model.*` (Idefics3VisionTransformer's) and `connector.modality_projection.proj.weight`
(engine.model.vision_names; the checkpoint layout: engine.model.architectures' idefics3 entry).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.llava import VisionLanguageModel
from engine.model.siglip_vision import SiglipVisionTower
from engine.vision_config import VisionConfig


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """Space to depth of square patch grids: x [N, side * side, D] (row-major patches) -> [N, (side / scale)^2,
    scale^2 * D], output row (I, J) the concatenation over (a, b) in row-major order of patch (I * scale + a,
    J * scale + b) (HF Idefics3Connector.pixel_shuffle's element order). Raises ValueError for a grid that is not
    square or whose side `scale` does not divide."""
    n, length, width = x.shape
    side = int(round(length ** 0.5))
    if side * side != length or side % scale:
        raise ValueError(f"the connector's pixel shuffle takes a square grid of patches whose side is a multiple of "
                         f"scale_factor {scale}; got {length} patches")
    s = side // scale
    return x.view(n, s, scale, s, scale, width).permute(0, 1, 3, 2, 4, 5).reshape(n, s * s, scale * scale * width)


class _Projection(nn.Module):
    """HF Idefics3SimpleMLP: one bias-free Linear `proj`."""

    def __init__(self, in_width: int, out_width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_width, out_width, bias=False)


class Idefics3Connector(nn.Module):
    """Pixel shuffle by v.scale_factor, then modality_projection.proj (vision width * scale^2 -> text width)."""

    def __init__(self, v: VisionConfig, text_width: int) -> None:
        super().__init__()
        self.scale = v.scale_factor
        self.modality_projection = _Projection(v.hidden_size * v.scale_factor ** 2, text_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, patches, vision width] -> [N, patches / scale^2, text width]."""
        return self.modality_projection.proj(pixel_shuffle(x, self.scale))


class Idefics3VLM(VisionLanguageModel):
    """The Idefics3 / SmolVLM model: the causal decoder of `cfg` plus `vision_model` and `connector`.

    encode_images: pixel_values [N, channels, S, S] (N tiles, each wholly valid; S a multiple of patch_size *
    scale_factor) -> features [N, (S / patch / scale)^2, hidden] in the model's dtype. Raises ValueError (at
    construction) for a config without `vision`."""

    def add_vision(self, v: VisionConfig, text_width: int) -> None:
        self.vision_model = SiglipVisionTower(v)
        self.connector = Idefics3Connector(v, text_width)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Feature rows of a batch of tiles, one per placeholder token (HF Idefics3Model.get_image_features: the
        encoder's last hidden state after post_layernorm, then the connector)."""
        return self.connector(self.vision_model(pixel_values))
