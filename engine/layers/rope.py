"""Rotary position embeddings (Su et al., "RoFormer", 2021; the rotate-half form of HF transformers) and their
scalings: linear, dynamic NTK, YaRN (Peng et al., 2023), Llama 3's per-frequency factors and LongRoPE (Ding et al.,
2024; Phi-3) (cfg.rope_scaling)."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, positions: torch.Tensor | None = None,
                  max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies (fp32) and the attention factor that multiplies cos/sin, exactly as HF transformers'
    `ROPE_INIT_FUNCTIONS` (transformers/modeling_rope_utils.py) computes them for cfg.rope_scaling.

    Returns inv_freq [R / 2] (R = cfg.rotary_dim or head_dim: the rotated dims, HF's partial_rotary_factor), or with
    "dynamic" scaling and `positions` (int64 [P]), [P, head_dim / 2]: the
    frequencies transformers uses for a sequence that ends at each position (its dynamic NTK recomputes them from the
    current length, max(position + 1, max_position_embeddings)). llama3 with GGUF `rope_freqs` divides the unscaled
    frequencies by those factors (llama.cpp's form of the same formula). longrope divides them by the long factors
    when `max_positions` (the engine's context) exceeds the original context, else by the short ones
    (engine.config.RopeScaling says why).
    """
    dim, base, rs = cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    if rs is None:
        return inv_freq, 1.0
    if rs.rope_type == "linear":
        return inv_freq / rs.factor, 1.0
    if rs.rope_type == "dynamic":
        if positions is None:
            return inv_freq, 1.0
        max_pos = cfg.max_position_embeddings
        seq_len = torch.clamp(positions.double() + 1, min=max_pos)
        bases = base * ((rs.factor * seq_len / max_pos) - (rs.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (bases.float()[:, None] ** exponents[None, :]), 1.0
    if rs.rope_type == "llama3":
        if rs.freq_factors is not None:
            factors = torch.tensor(rs.freq_factors, dtype=torch.float32)
            if factors.shape != inv_freq.shape:
                raise ValueError(f"rope_freqs has {factors.numel()} factors, head_dim {dim} needs {inv_freq.numel()}")
            return inv_freq / factors, 1.0
        old = rs.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rs.rope_type == "longrope":  # transformers' _compute_longrope_parameters, the set chosen once
        orig = rs.original_max_position_embeddings
        long = max_positions is not None and max_positions > orig
        factors = torch.tensor(rs.long_factor if long else rs.short_factor, dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope has {factors.numel()} factors, head_dim {dim} needs {inv_freq.numel()}")
        attention_factor = rs.attention_factor
        if attention_factor is None:
            attention_factor = 1.0 if rs.factor <= 1 else math.sqrt(1 + math.log(rs.factor) / math.log(orig))
        return 1.0 / (factors * base ** exponents), float(attention_factor)
    # yarn (Peng et al., "YaRN", 2023), transformers' _compute_yarn_parameters
    factor = rs.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.attention_factor
    if attention_factor is None:
        attention_factor = (float(mscale(factor, rs.mscale) / mscale(factor, rs.mscale_all_dim))
                            if rs.mscale and rs.mscale_all_dim else mscale(factor))
    beta_fast, beta_slow = rs.beta_fast or 32, rs.beta_slow or 1
    orig = rs.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE, [max_positions, R] each (R = cfg.rotary_dim or head_dim), looked up by position
    (int64 [T]); the frequencies and the cos/sin factor of `rope_inv_freq` (RoPE scaling of cfg.rope_scaling)."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.int64)
        inv_freq, attention_factor = rope_inv_freq(cfg, positions, max_positions)
        if inv_freq.dim() == 1:
            freqs = positions.float()[:, None] * inv_freq[None, :]
        else:
            freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, heads, head_dim] by cos/sin: [T, R], R <= head_dim: the first R dims of each head rotate
    (rotate-half within them), the others pass through (partial rotary, as HF's Phi-3 apply_rotary_pos_emb)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
    x_rot = x[..., :rot]
    return torch.cat((x_rot * cos[:, None, :] + _rotate_half(x_rot) * sin[:, None, :], x[..., rot:]), dim=-1)
