"""Qwen3-VL (HF Qwen3VLForConditionalGeneration, model_type "qwen3_vl"; the dense models): the vision tower of
engine.model.qwen3_vision before a Qwen3 causal decoder (the generic engine.model.decoder with q/k norms, through
engine.model.qwen_vl's M-RoPE model), with two changes from Qwen2.5-VL:

- Interleaved M-RoPE (HF Qwen3VLTextRotaryEmbedding): rotary frequency j reads the height position when
  j % 3 == 1 and j < 3 * section[1], the width position when j % 3 == 2 and j < 3 * section[2], the temporal one
  otherwise (Qwen2-VL gives each axis a contiguous block of frequencies instead). The positions themselves are
  Qwen2-VL's (engine.multimodal.mrope; HF's Qwen3-VL get_rope_index gives the same for images).
- DeepStack (Meng et al., "DeepStack", 2024; Qwen team, "Qwen3-VL Technical Report", 2025): `encode_images` gives each
  placeholder token 1 + K feature rows (engine.model.qwen3_vision); row 0 replaces the token's input embedding, and
  row i + 1 is added to the token's hidden state after decoder layer i, for the first K layers (HF
  Qwen3VLTextModel._deepstack_process). The model runner merges row 0 into inputs_embeds and passes rows 1..K with
  their step rows as `deepstack` (engine.model.base.DeepStackFeatures, gathered by engine.worker.mm_embeds); a step
  without image placeholders runs as the plain decoder.

Parameter names: the decoder's own and `visual.*` (HF's; engine.model.qwen_vl_names.qwen3_vl_param_shapes).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import AttentionMetadata, paged_attention_ref
from engine.layers.self_attn import AttentionFn
from engine.model.base import DeepStackFeatures
from engine.model.qwen3_vision import Qwen3VisionTower
from engine.model.qwen_vl import QwenVLModel
from engine.vision_config import Qwen3VisionConfig, QwenVisionConfig


def interleaved_mrope_axes(sections: tuple[int, ...], rotary_dim: int) -> tuple[int, ...]:
    """The position (0 temporal, 1 height, 2 width) each of the rotary_dim cos/sin columns reads under interleaved
    M-RoPE (HF Qwen3VLTextRotaryEmbedding.recomposition_frequencies), in both halves of the rotate-half layout.
    Raises ValueError when the sections do not cover rotary_dim / 2 frequencies."""
    if sum(sections) * 2 != rotary_dim:
        raise ValueError(f"rope mrope_section {list(sections)} covers {sum(sections)} frequencies; the text model's "
                         f"head_dim {rotary_dim} has {rotary_dim // 2}")
    half = tuple(1 if j % 3 == 1 and j < 3 * sections[1] else 2 if j % 3 == 2 and j < 3 * sections[2] else 0
                 for j in range(rotary_dim // 2))
    return half + half


class Qwen3VLModel(QwenVLModel):
    """The Qwen3-VL model: the Qwen3 decoder of `cfg` plus `visual` (Qwen3VisionTower), interleaved M-RoPE and
    DeepStack.

    encode_images(pixel_values, grid_thw) -> [sum of tokens, 1 + K, hidden] (QwenVLModel's, through this tower).
    forward: the decoder's, plus `deepstack` with inputs_embeds for a step that feeds image placeholders.
    Raises ValueError (at construction) for a config whose vision is not a Qwen3VisionConfig, or as QwenVLModel."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        if not isinstance(cfg.vision, Qwen3VisionConfig):
            raise ValueError(f"the qwen3_vl model needs a Qwen3VisionConfig (the {cfg.architecture} config has "
                             f"{type(cfg.vision).__name__})")
        super().__init__(cfg, max_positions)
        self.deepstack_layers = len(cfg.vision.deepstack_visual_indexes)

    def make_visual(self, v: QwenVisionConfig) -> nn.Module:
        """Qwen3VisionTower: features at 1 + K levels."""
        return Qwen3VisionTower(v)

    def rope_axes(self, sections: tuple[int, ...], rotary_dim: int) -> tuple[int, ...]:
        """interleaved_mrope_axes."""
        return interleaved_mrope_axes(sections, rotary_dim)

    def forward(self, input_ids: torch.Tensor | None, rope_rows: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                attn_fn: AttentionFn = paged_attention_ref, *, inputs_embeds: torch.Tensor | None = None,
                deepstack: DeepStackFeatures | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (LlamaModel.forward's), with deepstack.features[:, i]
        [N, hidden] added to the hidden states of rows deepstack.rows int64 [N] after decoder layer i, i < K. Raises
        ValueError for deepstack without inputs_embeds, or whose features are not [N, K, hidden]."""
        if deepstack is None:
            return super().forward(input_ids, rope_rows, kv_caches, meta, attn_fn, inputs_embeds=inputs_embeds)
        rows, features = deepstack
        k = self.deepstack_layers
        if inputs_embeds is None or features.shape != (rows.shape[0], k, self.config.hidden_size):
            raise ValueError(f"deepstack features {tuple(features.shape)} for {rows.shape[0]} rows must come with "
                             f"inputs_embeds and be [rows, {k}, {self.config.hidden_size}]")
        x = inputs_embeds
        ropes = self.layer_ropes(rope_rows, x.dtype)
        for i, (layer, (cos, sin), (k_cache, v_cache)) in enumerate(zip(self.layers, ropes, kv_caches, strict=True)):
            x = layer(x, cos, sin, k_cache, v_cache, meta, attn_fn)
            if i < k:
                x.index_add_(0, rows, features[:, i])  # the image rows' hidden states + their level i + 1
        return self.norm(x)
