"""LLaVA-1.5 (HF LlavaForConditionalGeneration): a CLIP vision tower (engine.model.clip_vision), a two-layer
projector (linear, activation, linear) into the language model's width, and a Llama-family causal decoder (the
generic engine.model.decoder, whose layers, embedding, norm and LM head this model is).

Sources: Liu et al., "Visual Instruction Tuning" (2023) and "Improved Baselines with Visual Instruction Tuning"
(LLaVA-1.5, 2023: the MLP projector, CLIP ViT-L/14-336's second-to-last layer); HF transformers' modeling_llava.py.

An image runs as `encode_images` (pixel values -> one row of language-model width per placeholder token); the model
runner merges those rows into the input embeddings at the image's placeholder tokens and calls `forward` with
`inputs_embeds` (engine.worker.mm_embeds). Parameter names: the decoder's own (layers.*, embed_tokens, norm,
lm_head), `vision_tower.*` (CLIPVisionModel's without "vision_model.") and `multi_modal_projector.*`
(engine.model.vision_names; the checkpoint layouts: engine.model.architectures' llava entry).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.clip_vision import ClipVisionTower, vision_act
from engine.model.decoder import LlamaModel
from engine.vision_config import VisionConfig


class LlavaProjector(nn.Module):
    """HF LlavaMultiModalProjector: linear_1 (vision width -> text width), the activation, linear_2."""

    def __init__(self, v: VisionConfig, text_width: int) -> None:
        super().__init__()
        self.act = v.projector_hidden_act
        self.linear_1 = nn.Linear(v.hidden_size, text_width, bias=v.projector_bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=v.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., vision width] -> [..., text width]."""
        return self.linear_2(vision_act(self.act, self.linear_1(x)))


class VisionLanguageModel(LlamaModel):
    """The causal decoder of `cfg` with an image encoder that a subclass adds in `add_vision` (its modules, named as
    its checkpoint names them). Raises ValueError (at construction) for a config without `vision`."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if cfg.vision is None:
            raise ValueError(f"the {type(self).__name__} model needs ModelConfig.vision (the {cfg.architecture} "
                             "config has none)")
        super().__init__(cfg, max_positions)
        self.add_vision(cfg.vision, cfg.hidden_size)

    def add_vision(self, v: VisionConfig, text_width: int) -> None:
        """Build the image encoder's modules for vision config `v` and the decoder's width. Every family's subclass
        defines it (LLaVA, LLaVA-NeXT, Idefics3, Gemma 3); raises NotImplementedError naming the class otherwise."""
        raise NotImplementedError(f"{type(self).__name__} builds no image encoder: a VisionLanguageModel subclass "
                                  "defines add_vision")


class LlavaVLM(VisionLanguageModel):
    """The LLaVA model: the causal decoder of `cfg` plus `vision_tower` and `multi_modal_projector`.

    encode_images: pixel_values [N, channels, image_size, image_size] (the model's image processor's) -> features
    [N, cfg.vision.tokens_per_image, hidden] in the model's dtype. Raises ValueError (at construction) for a config
    without `vision`."""

    def add_vision(self, v: VisionConfig, text_width: int) -> None:
        self.vision_tower = ClipVisionTower(v)
        self.multi_modal_projector = LlavaProjector(v, text_width)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Features of a batch of images, one row per placeholder token (HF LlavaModel.get_image_features: the
        feature layer's hidden states, the CLS row dropped under the "default" strategy, then the projector)."""
        features = self.vision_tower(pixel_values)
        if self.config.vision.select_strategy == "default":
            features = features[:, 1:]
        n, length, width = features.shape
        return self.multi_modal_projector(features.reshape(n * length, width)).view(n, length, -1)
