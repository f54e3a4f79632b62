"""The SigLIP vision encoder of Idefics3, SmolVLM and Gemma 3 (Zhai et al., "Sigmoid Loss for Language Image
Pre-Training", SigLIP 2023; its variable-resolution form after Dehghani et al., "Patch n' Pack: NaViT" 2023, as
Laurençon et al. train it for Idefics2/3) as HF transformers' Idefics3VisionTransformer and SiglipVisionTransformer
compute it: patches by a strided, biased convolution, learned position embeddings, no CLS token, no pre-norm, the
pre-norm encoder blocks of engine.model.clip_vision (SigLIP's are CLIP's: layer_norm1, self_attn q/k/v/out_proj,
layer_norm2, mlp fc1/fc2) and a final post_layernorm. Idefics3 indexes the positions by *bucketed* position ids (a
grid of any rows x cols patches maps onto the num_patches_per_side^2 learned positions by its fractional
coordinates); SigLIP proper (Gemma 3's tower) takes images of image_size only, patch i at position i, which the
bucketing does not always give (float rounding: side 19, 25, ...). Parameter names are both HF classes', so a
checkpoint's `model.vision_model.*` (Idefics3) or `vision_tower.vision_model.*` (Gemma 3) tensors fill it by name.

Padded pixels: HF masks the patches that a tile's pixel_attention_mask marks padding. Idefics3's and SmolVLM's image
processors only pad whole tiles (batch padding, dropped before the encoder: engine.multimodal.processor), so every
tile this encoder sees is wholly valid and attention needs no mask (HF then passes patch_attention_mask=None too).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.encoder_attention import EncoderMetadata
from engine.model.clip_vision import ClipEncoder, empty_on_meta
from engine.vision_config import VisionConfig


def bucketed_position_ids(rows: int, cols: int, side: int, device: torch.device) -> torch.Tensor:
    """int64 [rows * cols] position ids of a rows x cols patch grid (row-major) over `side` x `side` learned
    positions: each coordinate's fraction i / n of its axis (clamped below 1) falls into one of `side` buckets, id =
    bucket_row * side + bucket_col (HF Idefics3VisionEmbeddings.forward; float32 as there, so equal ids)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)

    def buckets(n: int) -> torch.Tensor:
        step = 1.0 / torch.tensor(n, device=device)  # float32, as HF's 1.0 / patch-count tensor
        frac = torch.arange(n, device=device, dtype=torch.float32) * step
        return torch.bucketize(torch.clamp(frac, max=1.0 - 1e-6), boundaries, right=True)

    return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)


class SiglipVisionEmbeddings(nn.Module):
    """Patch embeddings (Conv2d, kernel = stride = patch_size, with bias) plus learned positions: bucketed
    (Idefics3), or with `bucketed` False patch i's own (SiglipVisionEmbeddings without interpolation)."""

    def __init__(self, v: VisionConfig, bucketed: bool = True) -> None:
        super().__init__()
        self.patch_size = v.patch_size
        self.side = v.image_size // v.patch_size
        self.bucketed = bucketed
        self.patch_embedding = nn.Conv2d(v.num_channels, v.hidden_size, kernel_size=v.patch_size,
                                         stride=v.patch_size)
        self.position_embedding = nn.Embedding(v.num_patches, v.hidden_size,
                                               _weight=empty_on_meta(v.num_patches, v.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, channels, H, W] (any float dtype; cast to the weights'), H and W multiples of
        patch_size (both image_size when not bucketed) -> [N, (H / patch) * (W / patch), width]. Raises ValueError
        for another H or W."""
        _, _, h, w = pixel_values.shape
        size = self.side * self.patch_size
        if h % self.patch_size or w % self.patch_size or (not self.bucketed and (h, w) != (size, size)):
            raise ValueError(f"pixel_values are {h}x{w}; the SigLIP encoder takes sides that are multiples of its "
                             f"patch size {self.patch_size}" + ("" if self.bucketed else f", here {size}x{size}"))
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # [N, P, D]
        if not self.bucketed:
            return patches + self.position_embedding.weight[None]
        ids = bucketed_position_ids(h // self.patch_size, w // self.patch_size, self.side, patches.device)
        return patches + self.position_embedding(ids)[None]


class SiglipVisionTower(nn.Module):
    """Idefics3VisionTransformer (`bucketed` positions), or SiglipVisionTransformer without its pooling head (not
    `bucketed`): `forward` gives the last hidden state after post_layernorm."""

    def __init__(self, v: VisionConfig, bucketed: bool = True) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(v, bucketed)
        self.encoder = ClipEncoder(v)
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, channels, H, W] (every tile wholly valid) -> [N, patches, width] in the weights'
        dtype (HF's last_hidden_state). Raises ValueError as SiglipVisionEmbeddings."""
        x = self.embeddings(pixel_values)
        n, length, width = x.shape
        meta = EncoderMetadata.of([length] * n, x.device)
        h = x.reshape(n * length, width)
        for layer in self.encoder.layers:
            h = layer(h, meta)
        return self.post_layernorm(h).view(n, length, width)
