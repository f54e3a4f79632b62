"""The Qwen2-VL / Qwen2.5-VL vision transformer (HF Qwen2_5_VisionTransformerPretrainedModel and
Qwen2VisionTransformerPretrainedModel) for engine.model.qwen_vl: images at their own resolution (a grid of t x h x w
patches each), a patch embedding, pre-norm blocks of bidirectional attention with a 2D rotary embedding, and the
patch merger that joins spatial_merge_size^2 neighbouring patches into one token of the language model's width.

Sources: Wang et al., "Qwen2-VL" (2024: naive dynamic resolution, 2D RoPE in the ViT, the MLP merger); Bai et al.,
"Qwen2.5-VL Technical Report" (2025: window attention in all but a few full-attention blocks, RMSNorm, SwiGLU); HF
transformers' modeling_qwen2_5_vl.py and modeling_qwen2_vl.py (the math and parameter names; no code of them).

Layout of the rows. The processor flattens each image's patches merge-block by merge-block: the spatial_merge_size^2
patches of one merged token are consecutive rows, blocks in row-major order of the merged grid. Window attention
(Qwen2.5-VL) groups merged tokens into windows of merger_window^2 (clipped at the image's edge); the tower runs its
rows in window order (each window's merged tokens row-major within it), so a window is a contiguous run of rows and
every attention call is engine.layers.encoder_attention over packed runs: one run per window in windowed blocks, one
run per image in full-attention blocks (images never attend to each other: HF's cu_seqlens). The merger's output is
put back into the processor's order.

The patch embedding is HF's Conv3d whose kernel equals its stride over a [channels, frames, patch, patch] patch: a
matrix product with the flattened patch, kept in the checkpoint's 5-D shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.encoder_attention import EncoderMetadata, encoder_attention
from engine.layers.rope import apply_rope
from engine.model.clip_vision import vision_act
from engine.vision_config import QwenVisionConfig


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    """The tower MLP's activation: SiLU, or one of the CLIP tower's (engine.model.clip_vision.vision_act)."""
    return F.silu(x) if name == "silu" else vision_act(name, x)


class QwenRMSNorm(nn.Module):
    """RMSNorm in fp32, then the weight in x's dtype (HF Qwen2_5_VLRMSNorm / Qwen2RMSNorm). x [..., d] -> same."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(v: QwenVisionConfig, dim: int) -> nn.Module:
    return QwenRMSNorm(dim, v.norm_eps) if v.style == "rms" else nn.LayerNorm(dim, eps=v.norm_eps)


class PatchEmbed(nn.Module):
    """Patches [P, channels * frames * patch^2] -> [P, hidden] (HF's Conv3d, as a matrix product): bias-free
    (Qwen2-VL, Qwen2.5-VL) or with a bias (Qwen3-VL)."""

    def __init__(self, v: QwenVisionConfig, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(v.hidden_size, v.in_channels, v.temporal_patch_size,
                                                    v.patch_size, v.patch_size))
        self.proj.bias = nn.Parameter(torch.empty(v.hidden_size)) if bias else None

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    """Fused qkv (biased), the 2D rotary embedding on q and k, bidirectional attention within meta's runs, proj."""

    def __init__(self, v: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads, v.hidden_size // v.num_heads
        self.qkv = nn.Linear(v.hidden_size, 3 * v.hidden_size)
        self.proj = nn.Linear(v.hidden_size, v.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        """x [T, hidden], cos/sin [T, head_dim] fp32 -> [T, hidden], x's dtype."""
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        q = apply_rope(qkv[:, 0].float(), cos, sin).to(x.dtype)  # HF rotates in fp32
        k = apply_rope(qkv[:, 1].float(), cos, sin).to(x.dtype)
        return self.proj(encoder_attention(torch.stack([q, k, qkv[:, 2]], dim=1), meta))


class VisionMLP(nn.Module):
    """SwiGLU with biases (gate_proj, up_proj, down_proj: Qwen2.5-VL) or fc1, act, fc2 (Qwen2-VL)."""

    def __init__(self, v: QwenVisionConfig) -> None:
        super().__init__()
        self.act, self.gated = v.hidden_act, v.style == "rms"
        d, i = v.hidden_size, v.intermediate_size
        if self.gated:
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, i), nn.Linear(d, i), nn.Linear(i, d)
        else:
            self.fc1, self.fc2 = nn.Linear(d, i), nn.Linear(i, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(_act(self.act, self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(_act(self.act, self.fc1(x)))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.)) (HF Qwen2_5_VLVisionBlock / Qwen2VLVisionBlock, and
    Qwen3VLVisionBlock: Qwen2-VL's with a GELU-tanh MLP)."""

    def __init__(self, v: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(v, v.hidden_size), _norm(v, v.hidden_size)
        self.attn = VisionAttention(v)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, meta)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """ln_q, then spatial_merge_size^2 consecutive rows joined and an MLP (Linear, exact GELU, Linear) into the
    language model's width (HF Qwen2_5_VLPatchMerger / PatchMerger)."""

    def __init__(self, v: QwenVisionConfig) -> None:
        super().__init__()
        self.width = v.hidden_size * v.spatial_merge_size ** 2
        self.ln_q = _norm(v, v.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, v.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T / merge^2, out_hidden]."""
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


def window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(merged-token order int64 [t * h/merge * w/merge], window sizes in merged tokens) of one image of patch grid
    `grid`: its merged tokens grouped into windows of window x window (row-major windows, row-major within each,
    edge windows smaller; each frame apart), as HF's get_vision_window_index orders them. window 0: one window of
    each frame's tokens in order."""
    t, gh, gw = grid[0], grid[1] // merge, grid[2] // merge
    if window <= 0:
        return torch.arange(t * gh * gw), [gh * gw] * t
    r = torch.arange(gh)[:, None].expand(gh, gw)
    c = torch.arange(gw)[None, :].expand(gh, gw)
    nww = -(-gw // window)
    win = ((r // window) * nww + c // window).reshape(-1)
    order = torch.argsort(win * (gh * gw) + torch.arange(gh * gw))  # by window, row-major within it
    sizes = torch.bincount(win, minlength=int(win.max()) + 1)
    sizes = [int(s) for s in sizes if s > 0]
    orders = [order + f * gh * gw for f in range(t)]
    return torch.cat(orders), sizes * t


def check_patches(patches: torch.Tensor, grids: list[tuple[int, int, int]], v: QwenVisionConfig) -> None:
    """Raise ValueError unless patches is [sum of t*h*w over grids, v.patch_dim] (the processor's pixel_values of
    images of those grids)."""
    if patches.dim() != 2 or patches.shape[0] != sum(t * h * w for t, h, w in grids) or (
            patches.shape[1] != v.patch_dim):
        raise ValueError(f"pixel_values {tuple(patches.shape)} do not match image grids {grids} of "
                         f"{v.patch_dim}-value patches")


def vision_rotary(positions: torch.Tensor, v: QwenVisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) fp32 [T, head_dim] of the tower's 2D rotary embedding (HF's VisionRotaryEmbedding) for patches at
    (row, column) positions int64 [T, 2]: rows rotate the first quarter of a head's frequencies and columns the
    second (rope_theta's frequencies over head_dim / 2), in the rotate-half layout."""
    half = v.hidden_size // v.num_heads // 2  # rows and columns each rotate half of a head's dims
    inv_freq = 1.0 / v.rope_theta ** (torch.arange(0, half, 2, device=positions.device).float() / half)
    freqs = (positions.float()[..., None] * inv_freq).flatten(1)  # [T, 2 * head_dim / 4]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def patch_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(row, column) int64 [t * h * w, 2] of each patch of one image in the processor's merge-block order (HF's
    get_vision_position_ids): the coordinates its 2D rotary embedding rotates by."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    blocks = (h // merge, merge, w // merge, merge)
    pos = torch.stack([a.reshape(blocks).transpose(1, 2).reshape(-1) for a in (rows, cols)], dim=-1)
    return pos.repeat(t, 1)


class QwenVisionTower(nn.Module):
    """The vision transformer and merger: `forward(patches, grids)` -> merged features of every image.

    Parameter names are HF's (`patch_embed.proj.weight`, `blocks.{i}.norm1/attn.qkv/attn.proj/mlp.*/norm2`,
    `merger.ln_q`, `merger.mlp.0`, `merger.mlp.2`), so a checkpoint's `visual.*` tensors fill it by name."""

    def __init__(self, v: QwenVisionConfig) -> None:
        super().__init__()
        self.config = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.num_layers))
        self.merger = PatchMerger(v)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [sum of t*h*w, patch_dim] (the processor's pixel_values of the images, concatenated in order),
        grids: each image's (t, h, w) -> features [sum of tokens_of(grid), out_hidden] in the weights' dtype, the
        images' rows in order. Raises ValueError when the rows do not match the grids."""
        v, merge = self.config, self.config.spatial_merge_size
        unit = merge * merge
        check_patches(patches, grids, v)
        device = patches.device
        orders, windows, positions, first = [], [], [], 0
        for grid in grids:
            order, sizes = window_order(grid, merge, v.merger_window)
            orders.append(order + first)
            first += order.numel()
            windows += [s * unit for s in sizes]
            positions.append(patch_positions(grid, merge))
        units = torch.cat(orders)  # merged-token order the tower runs in
        rows = (units[:, None] * unit + torch.arange(unit)).reshape(-1).to(device)
        cos, sin = vision_rotary(torch.cat(positions).to(device)[rows], v)
        full = EncoderMetadata.of([h * w for t, h, w in grids for _ in range(t)], device)  # per frame, as HF
        windowed = EncoderMetadata.of(windows, device) if v.merger_window else full
        x = self.patch_embed(patches)[rows]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, windowed if v.windowed(i) else full)
        merged = self.merger(x)
        return merged[torch.argsort(units.to(device))]
