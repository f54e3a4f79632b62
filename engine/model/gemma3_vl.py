"""Gemma 3 vision-language (HF Gemma3ForConditionalGeneration): a SigLIP vision tower (engine.model.siglip_vision,
positions by patch index), a projector that average-pools the tower's patch grid to mm_tokens_per_image rows,
normalizes them (Gemma's RMSNorm of 1 + weight) and multiplies by one bias-free matrix into the text width, and the
Gemma 3 text decoder (engine.model.gemma: sandwich norms, scaled embeddings, sliding and global layers with their own
RoPE bases).

Sources: Gemma Team, "Gemma 3 Technical Report" (2025); Zhai et al., SigLIP (2023); HF transformers'
modeling_gemma3.py (Gemma3MultiModalProjector, get_image_features, and the mask of create_masks_for_vision_model).

An image is one run of soft tokens between <start_of_image> and <end_of_image> (Gemma3Processor writes
"\\n\\n<start_of_image>" + mm_tokens_per_image soft tokens + "<end_of_image>\\n\\n" for each image): one
engine.multimodal MultiModalItem, whose feature rows the model runner merges at the soft tokens after the scaled
token embeddings (engine.worker.mm_embeds), as HF's masked_scatter does. In prefill the soft tokens of one image
attend to each other, earlier ones to later ones too (HF's token_type_ids: OR(causal, same image), and on the
sliding layers AND the window); `bidirectional_images` tells the runner to pass each prefill chunk's images to the
attention (AttentionMetadata.image_spans) and the scheduler never to end a prefill chunk inside an image. Parameter
names: the decoder's (layers.*, embed_tokens, norm; the LM head tied), `vision_tower.*` (SiglipVisionTransformer's
without "vision_model.") and `multi_modal_projector.*` (engine.model.vision_names; the checkpoint layouts:
engine.model.architectures' gemma3_vl entry).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.rms_norm import RMSNorm
from engine.model.gemma import GemmaModel
from engine.model.llava import VisionLanguageModel
from engine.model.siglip_vision import SiglipVisionTower
from engine.vision_config import VisionConfig


class Gemma3Projector(nn.Module):
    """HF Gemma3MultiModalProjector: average pooling of the patch grid by v.scale_factor (kernel = stride),
    mm_soft_emb_norm (RMSNorm of 1 + weight, the tower's layer_norm_eps), then mm_input_projection_weight
    [vision width, text width]."""

    def __init__(self, v: VisionConfig, text_width: int) -> None:
        super().__init__()
        self.side = v.image_size // v.patch_size
        self.kernel = v.scale_factor
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, v.layer_norm_eps, offset=1.0)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(v.hidden_size, text_width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, side * side, vision width] (row-major patches) -> [N, (side / kernel)^2, text width] in x's dtype.
        Raises ValueError for another number of patches."""
        n, length, width = x.shape
        if length != self.side * self.side:
            raise ValueError(f"the Gemma 3 projector takes {self.side}x{self.side} patches per image, got {length}")
        grid = x.transpose(1, 2).reshape(n, width, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [N, tokens, width]
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight.to(x.dtype)).to(x.dtype)


class Gemma3VLM(VisionLanguageModel, GemmaModel):
    """The Gemma 3 vision-language model: GemmaModel (the decoder of `cfg`) plus `vision_tower` and
    `multi_modal_projector`.

    encode_images: pixel_values [N, channels, image_size, image_size] (Gemma3ImageProcessor's) -> features
    [N, cfg.vision.tokens_per_image, hidden] in the model's dtype. Raises ValueError (at construction) for a config
    without `vision` or that is not Gemma's (GemmaModel)."""

    bidirectional_images: ClassVar[bool] = True

    def add_vision(self, v: VisionConfig, text_width: int) -> None:
        self.vision_tower = SiglipVisionTower(v, bucketed=False)
        self.multi_modal_projector = Gemma3Projector(v, text_width)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Feature rows of a batch of images, one per soft token (HF Gemma3Model.get_image_features: the tower's
        last hidden state after post_layernorm, then the projector). Raises ValueError as SiglipVisionTower."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))
