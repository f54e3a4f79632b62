"""The Qwen3-VL vision transformer (HF Qwen3VLVisionModel) for engine.model.qwen3_vl: Qwen2-VL's dynamic-resolution
tower (engine.model.qwen_vision: the patch embedding, 2D rotary attention, the processor's merge-block row order)
with LayerNorm blocks and full attention over each image frame, a GELU-tanh MLP, a learned position embedding
resampled to each image's grid, and DeepStack: the outputs of chosen blocks, each joined spatial_merge_size^2 patches
at a time by a merger of its own, become extra feature levels that the language model adds to its hidden states after
its first layers (engine.model.qwen3_vl).

Sources: Qwen team, "Qwen3-VL Technical Report" (2025); Meng et al., "DeepStack: Deeply Stacking Visual Tokens is
Surprisingly Simple and Effective for LMMs" (2024); HF transformers' modeling_qwen3_vl.py and vision_utils.py
(`get_vision_interpolation_indices_and_weights`: the learned grid is resampled bilinearly with aligned corners; the
math and parameter names, no code of them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.encoder_attention import EncoderMetadata
from engine.model.qwen_vision import PatchEmbed, VisionBlock, check_patches, patch_positions, vision_rotary
from engine.vision_config import Qwen3VisionConfig, QwenVisionConfig


class Qwen3PatchMerger(nn.Module):
    """spatial_merge_size^2 consecutive rows joined into one, then linear_fc1, exact GELU, linear_fc2 into the language
    model's width (HF Qwen3VLVisionPatchMerger). `norm` (LayerNorm, eps 1e-6) runs before the join over each row (the
    main merger), or after it over the joined row (DeepStack's mergers: use_postshuffle_norm)."""

    def __init__(self, v: QwenVisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width = v.hidden_size * v.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else v.hidden_size, eps=v.norm_eps)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, v.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T / merge^2, out_hidden]."""
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def grid_position_embedding(table: torch.Tensor, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """The learned position embedding of an image of patch grid `grid` (frames, rows, columns): the square table
    [side * side, hidden] resampled to rows x columns (bilinear, corners aligned: F.interpolate's, as HF's
    interpolation indices and weights), in fp32, one row per patch in the processor's merge-block order, repeated for
    each frame -> fp32 [t * h * w, hidden]."""
    side = int(table.shape[0] ** 0.5)
    t, h, w = grid
    square = table.float().t().reshape(1, -1, side, side)
    resampled = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
    pos = patch_positions((1, h, w), merge).to(table.device)
    return resampled[:, pos[:, 0], pos[:, 1]].t().repeat(t, 1)


class Qwen3VisionTower(nn.Module):
    """The Qwen3-VL vision transformer, merger and DeepStack mergers: `forward(patches, grids)` -> every image's
    features at 1 + K levels.

    Parameter names are HF's (`patch_embed.proj`, `pos_embed`, `blocks.{i}.norm1/attn.qkv/attn.proj/norm2`,
    `merger.norm/linear_fc1/linear_fc2`, `deepstack_merger_list.{k}.*`), so a checkpoint's `visual.*` tensors fill it
    by name, but for the blocks' MLP: Qwen2-VL's (engine.model.qwen_vision.VisionMLP, style "layer": `mlp.fc1`,
    `mlp.fc2`), HF's `mlp.linear_fc1` / `mlp.linear_fc2` renamed on load (engine.model.architectures' qwen3_vl).
    Raises ValueError (at construction) for a config that is not a Qwen3VisionConfig."""

    def __init__(self, v: QwenVisionConfig) -> None:
        super().__init__()
        if not isinstance(v, Qwen3VisionConfig):
            raise ValueError(f"the Qwen3-VL vision tower needs a Qwen3VisionConfig, not {type(v).__name__}")
        self.config = v
        self.patch_embed = PatchEmbed(v, bias=True)
        # An empty weight: on the meta device nn.Embedding's normal_ init would import torch._dynamo (decoder's NOTE).
        self.pos_embed = nn.Embedding(v.num_position_embeddings, v.hidden_size,
                                      _weight=torch.empty(v.num_position_embeddings, v.hidden_size))
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.num_layers))
        self.merger = Qwen3PatchMerger(v, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(v, postshuffle=True)
                                                   for _ in v.deepstack_visual_indexes)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [sum of t*h*w, patch_dim] (the processor's pixel_values of the images, concatenated in order),
        grids: each image's (t, h, w) -> features [sum of tokens_of(grid), 1 + K, out_hidden] in the weights' dtype,
        the images' rows in order: level 0 the merger's (the input embeddings), level k the k-th DeepStack feature
        (HF's deepstack_features order: the tapped blocks in ascending order, each through the merger at its index in
        deepstack_visual_indexes). Raises ValueError when the rows do not match the grids."""
        v, merge = self.config, self.config.spatial_merge_size
        check_patches(patches, grids, v)
        device = patches.device
        cos, sin = vision_rotary(torch.cat([patch_positions(g, merge) for g in grids]).to(device), v)
        meta = EncoderMetadata.of([h * w for t, h, w in grids for _ in range(t)], device)  # per frame, as HF
        x = self.patch_embed(patches)
        table = self.pos_embed.weight
        x = x + torch.cat([grid_position_embedding(table, g, merge) for g in grids]).to(x.dtype)
        deep, taps = [], v.deepstack_visual_indexes
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, meta)
            if i in taps:
                deep.append(self.deepstack_merger_list[taps.index(i)](x))
        return torch.stack([self.merger(x), *deep], dim=1)
