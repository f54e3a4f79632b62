"""Rotary position embeddings (Su et al., "RoFormer", 2021; the rotate-half form of HF transformers) and their
scalings: linear, dynamic NTK, YaRN (Peng et al., 2023), Llama 3's per-frequency factors and LongRoPE (Ding et al.,
2024; Phi-3) (cfg.rope_scaling)."""

from __future__ import annotations

import math
from typing import TypeVar

import numpy as np
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
    when `max_positions` (the length of the sequence, transformers' seq_len) exceeds the original context, else by
    the short ones (RotaryEmbedding keeps both sets: `longrope_table_rows` says which a token takes).
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
    if rs.rope_type == "longrope":  # transformers' _compute_longrope_parameters
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


Rows = TypeVar("Rows", torch.Tensor, np.ndarray)


def longrope_table_rows(positions: Rows, start_lens: Rows | int, original: int) -> Rows:
    """Rows of a LongRoPE RotaryEmbedding's tables (short factors at rows [0, original), long ones from `original`
    on) for tokens at `positions` (int64 [T]) of sequences that held `start_lens` tokens when their KV cache started
    (int64 [T] or one int; engine.core.request.Request.kv_start_len): the long factors where that length or the
    position passes the original context, else the short ones. Works on torch tensors and numpy arrays alike.

    Source: HF transformers' generate. Its `longrope_frequency_update` (transformers/modeling_rope_utils.py) takes
    the long set for a forward call when the call's sequence length, max(position_ids) + 1, exceeds the original
    context; Phi-3's `prepare_inputs_for_generation` drops the KV cache when a sequence first passes it, so the
    whole sequence is encoded again with the long set (engine.core.scheduler.Scheduler recomputes such a request,
    whose kv_start_len is then past it). A row that stays within the original context takes the short set only.
    """
    long = (positions >= original) | (start_lens > original)
    return positions + long * original


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE, [N, R] each (R = cfg.rotary_dim or head_dim), looked up by table row (int64 [T]);
    the frequencies and the cos/sin factor of `rope_inv_freq` (RoPE scaling of cfg.rope_scaling).

    N = max_positions, and the row of a token is its position; except with LongRoPE whose `max_positions` exceeds
    the original context O (`long_from` = O): then rows [0, O) hold the short factors' positions 0..O-1 and rows
    [O, O + max_positions) the long factors' positions 0..max_positions-1, and `table_rows` maps positions to rows
    by HF's rule (`longrope_table_rows`). With max_positions <= O every sequence is within O: the short set only.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        rs = cfg.rope_scaling
        orig = rs.original_max_position_embeddings if rs is not None and rs.rope_type == "longrope" else None
        self.long_from: int | None = orig if orig is not None and max_positions > orig else None
        if self.long_from is None:
            cos, sin = self._tables(cfg, max_positions, max_positions)
        else:
            short, long = self._tables(cfg, orig, orig), self._tables(cfg, max_positions, orig + 1)
            cos, sin = torch.cat((short[0], long[0])), torch.cat((short[1], long[1]))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @staticmethod
    def _tables(cfg: ModelConfig, n: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) fp32 [n, R] of positions 0..n-1 with the frequencies of a sequence of seq_len tokens."""
        positions = torch.arange(n, dtype=torch.int64)
        inv_freq, attention_factor = rope_inv_freq(cfg, positions, seq_len)
        if inv_freq.dim() == 1:
            freqs = positions.float()[:, None] * inv_freq[None, :]
        else:
            freqs = positions.float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * attention_factor, emb.sin() * attention_factor

    def table_rows(self, positions: Rows, start_lens: Rows | int) -> Rows:
        """The table rows (int64 [T]) of tokens at `positions` (int64 [T], torch or numpy) of sequences whose KV
        caches started at `start_lens` tokens (int64 [T] or one int; a whole sequence encoded at once: its length):
        the positions themselves unless LongRoPE keeps two sets (`longrope_table_rows`)."""
        return positions if self.long_from is None else longrope_table_rows(positions, start_lens, self.long_from)

    def forward(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R] in `dtype` of table rows int64 [T] (`table_rows`; the positions without LongRoPE)."""
        return self.cos[rows].to(dtype), self.sin[rows].to(dtype)


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
