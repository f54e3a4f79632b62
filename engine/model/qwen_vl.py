"""Qwen2-VL and Qwen2.5-VL (HF Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration): the vision
transformer and patch merger of engine.model.qwen_vision before a Qwen2 causal decoder (the generic
engine.model.decoder, whose layers, embedding, norm and LM head this model is) with multimodal RoPE.

Multimodal RoPE (M-RoPE; Wang et al., "Qwen2-VL", 2024; Bai et al., "Qwen2.5-VL Technical Report", 2025; HF
modeling_qwen2_5_vl.py): each token has three positions (temporal, height, width) and the rotary frequencies are
split in three sections (config rope mrope_section, in frequencies: their sum is head_dim / 2), section k rotated by
position k. A text token's three positions are equal (plain RoPE); an image's tokens take their grid coordinates
offset by the image's start (engine.multimodal.mrope). `forward`'s rope_rows is int64 [3, T] (the three positions of
each token) or, for a step without image prompts, int64 [T] (the three equal): the model runner picks
(engine.multimodal.mrope.step_rope_rows). The RoPE tables are the decoder's (default RoPE of rope_theta): M-RoPE
reads each column of cos/sin at its section's position.

Images run as `encode_images(pixel_values, grid_thw)`: the images' patches concatenated and their grids -> one row of
language-model width per placeholder token; the model runner merges those rows into the input embeddings
(engine.worker.mm_embeds). Parameter names: the decoder's own and `visual.*` (HF's; engine.model.qwen_vl_names).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.decoder import LlamaModel
from engine.model.qwen_vision import QwenVisionTower
from engine.vision_config import QwenVisionConfig


def mrope_axes(sections: tuple[int, ...], rotary_dim: int) -> tuple[int, ...]:
    """The position (0 temporal, 1 height, 2 width) each of the rotary_dim cos/sin columns reads: section k's
    frequencies read position k, in both halves of the rotate-half layout. Raises ValueError when the sections do not
    cover rotary_dim / 2 frequencies."""
    if sum(sections) * 2 != rotary_dim:
        raise ValueError(f"rope mrope_section {list(sections)} covers {sum(sections)} frequencies; the text model's "
                         f"head_dim {rotary_dim} has {rotary_dim // 2}")
    half = tuple(k for k, n in enumerate(sections) for _ in range(n))
    return half + half


class QwenVLModel(LlamaModel):
    """The Qwen2-VL / Qwen2.5-VL model: the causal decoder of `cfg` plus `visual`, with M-RoPE. A later family
    (engine.model.qwen3_vl) overrides `make_visual` and `rope_axes`.

    Raises ValueError (at construction) for a config whose vision is not a QwenVisionConfig, or whose M-RoPE sections
    do not match the head size."""

    uses_mrope: ClassVar[bool] = True  # forward takes rope_rows [3, T] (ModelBase.uses_mrope)

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if not isinstance(cfg.vision, QwenVisionConfig):
            raise ValueError(f"the qwen_vl model needs a QwenVisionConfig (the {cfg.architecture} config has "
                             f"{type(cfg.vision).__name__})")
        super().__init__(cfg, max_positions)
        self.visual = self.make_visual(cfg.vision)
        self._axes = self.rope_axes(cfg.vision.mrope_section, cfg.rotary_dim or cfg.head_dim)
        self._gather: tuple[torch.Tensor, torch.Tensor] | None = None

    def make_visual(self, v: QwenVisionConfig) -> nn.Module:
        """The vision tower: QwenVisionTower (the patch merger's rows of language-model width)."""
        return QwenVisionTower(v)

    def rope_axes(self, sections: tuple[int, ...], rotary_dim: int) -> tuple[int, ...]:
        """The position each cos/sin column reads: mrope_axes (Qwen2-VL's sections)."""
        return mrope_axes(sections, rotary_dim)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Features [sum of placeholder tokens, hidden] (model dtype) of images whose patches pixel_values
        [sum of t*h*w, patch_dim] (the processor's, concatenated) and grids grid_thw int64 [N, 3] give. Raises
        ValueError without grid_thw or as QwenVisionTower.forward."""
        if grid_thw is None:
            raise ValueError("Qwen2-VL images need their grid_thw (the processor's image_grid_thw)")
        return self.visual(pixel_values, [tuple(int(n) for n in g) for g in grid_thw.tolist()])

    def layer_ropes(self, rope_rows: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) [T, R] in `dtype`: of rope_rows int64 [3, T] (M-RoPE: column j at position
        axes[j]), or int64 [T] (equal positions: the decoder's plain RoPE)."""
        if rope_rows.dim() == 1:
            return super().layer_ropes(rope_rows, dtype)
        if self._gather is None or self._gather[0].device != rope_rows.device:
            axes = torch.tensor(self._axes, dtype=torch.int64, device=rope_rows.device)
            self._gather = axes, torch.arange(len(self._axes), device=rope_rows.device)[None, :]
        axes, cols = self._gather
        rows = rope_rows.t()[:, axes]  # [T, R]: each token's position for each column
        cos = self.rotary.cos[rows, cols].to(dtype)
        sin = self.rotary.sin[rows, cols].to(dtype)
        return [(cos, sin)] * len(self.layers)
