"""RoPE scaling of a model config: how the rotary frequencies change (ModelConfig.rope_scaling). Public API as the
type of that field (exported by engine/__init__.py); its own module only because engine/config.py is at the file
size limit, and no subpackage can hold it: every one that knows RoPE imports engine.config."""

from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are changed from theta ** (-2i / head_dim), as HF transformers'
    `ROPE_INIT_FUNCTIONS` (transformers/modeling_rope_utils.py) computes them (engine.layers.rope.rope_inv_freq).

    Attributes:
        rope_type: "linear" (position interpolation, Chen et al. 2023: inv_freq / factor), "dynamic" (dynamic NTK:
            the base grows with the sequence length past max_position_embeddings), "yarn" (Peng et al., YaRN, 2023)
            "llama3" (Meta Llama 3.1's wavelength-banded scaling) or "longrope" (Ding et al., "LongRoPE", 2024;
            Phi-3: per-frequency divisors, `short_factor` or `long_factor` by the context the engine runs).
        factor: the scaling factor (all types).
        original_max_position_embeddings: pretraining context (llama3, yarn).
        low_freq_factor / high_freq_factor: llama3's band edges.
        beta_fast / beta_slow / mscale / mscale_all_dim / attention_factor / truncate: yarn's parameters (None =
            transformers' defaults).
        freq_factors: per-frequency divisors of the unscaled inv_freq [head_dim / 2] (GGUF `rope_freqs.weight`, as
            llama.cpp's converter writes Llama 3's scaling); when set they are used instead of the llama3 formula.
        short_factor / long_factor: longrope's per-frequency divisors [head_dim / 2], picked per sequence as HF
            transformers' generate picks them: the long ones once the sequence passes
            original_max_position_embeddings, else the short ones (engine.layers.rope.longrope_table_rows; vLLM and
            llama.cpp pick one set for the whole run by its context). attention_factor multiplies cos/sin (default
            sqrt(1 + ln(factor) / ln(original))).

    Raises:
        ValueError: for an unknown rope_type or a missing parameter.
    """

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    freq_factors: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not implemented; tokenmill runs "
                             f"{', '.join(ROPE_TYPES[1:])} (or none)")
        for name in ("freq_factors", "short_factor", "long_factor"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.freq_factors is None and None in (
                self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings):
            raise ValueError("rope_scaling llama3 needs low_freq_factor, high_freq_factor and "
                             "original_max_position_embeddings (or GGUF rope_freqs)")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("rope_scaling yarn needs original_max_position_embeddings")
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None
                                             or self.original_max_position_embeddings is None):
            raise ValueError("rope_scaling longrope needs short_factor, long_factor and "
                             "original_max_position_embeddings")
