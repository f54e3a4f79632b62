"""RoPE scaling of a GGUF file: its `{arch}.rope.scaling.*` metadata, or the RoPE factor tensors llama.cpp's
convert_hf_to_gguf.py writes (Llama 3's `rope_freqs`, Phi-3's `rope_factors_long` / `_short`), as a RopeScaling; a
key whose math tokenmill does not implement is an error naming it.

Sources: llama.cpp convert_hf_to_gguf.py (TextModel.set_gguf_parameters: what it writes for each HF rope type) and
llama-model.cpp (what it reads); gguf-py's constants (the key names).
"""

from __future__ import annotations

from typing import Any

from engine.config import RopeScaling

#: Phi-3's LongRoPE factors (llama.cpp's rope_factors_long / rope_factors_short), read into cfg.rope_scaling.
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
ROPE_TENSORS = ("rope_freqs.weight", *ROPE_FACTORS)

#: llama.cpp's YaRN knobs beyond HF's rope_scaling and the value that leaves HF's YaRN unchanged: an extrapolation
#: mix (ext_factor: llama.cpp's default for YaRN, 1), an extra attention scale on top of YaRN's own mscale
#: (yarn_attn_factor, 1) and DeepSeek's log multiplier of the mscale (yarn_log_multiplier, 0).
_YARN_LLAMA_CPP_KEYS = {"yarn_ext_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}


def _factors(tensor: Any) -> tuple[float, ...]:
    """The values of a 1-D GGUF tensor (RoPE factors), as floats."""
    import numpy as np
    from gguf.quants import dequantize

    return tuple(np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1).tolist())


def gguf_rope_scaling(get: Any, tensors: dict[str, Any], max_pos: int, yarn_truncate: bool = True
                      ) -> RopeScaling | None:
    """RoPE scaling of a GGUF file: `rope_freqs.weight` (Llama 3's per-frequency factors), `rope_factors_long` /
    `rope_factors_short` (Phi-3's LongRoPE, with `rope.scaling.original_context_length` and `.attn_factor`), or
    `rope.scaling.type` linear / yarn with its factor, original context and yarn betas.

    Args:
        get: `get(key without "{arch}.", default)`, the file's metadata.
        tensors: the file's tensors by name.
        max_pos: the file's context length (tokens).
        yarn_truncate: whether YaRN's correction range is rounded to whole dims (HF's `truncate`); a GGUF file does
            not say (llama.cpp always rounds), the family does (engine.model.architectures.Architecture).
    Raises:
        ValueError naming a scaling type or a llama.cpp YaRN key (`_YARN_LLAMA_CPP_KEYS` set to another value) that
        tokenmill does not implement, or factor tensors that contradict the metadata.
    """
    kind = get("rope.scaling.type", None)
    rope_freqs = tensors.get("rope_freqs.weight")
    if rope_freqs is not None or ROPE_FACTORS[0] in tensors:
        if kind not in (None, "none"):
            raise ValueError(f"GGUF has both RoPE factor tensors and rope.scaling.type {kind!r}; tokenmill cannot "
                             "tell which RoPE scaling the model was trained with")
        if rope_freqs is not None:
            return RopeScaling(rope_type="llama3", freq_factors=_factors(rope_freqs))
        if ROPE_FACTORS[1] not in tensors:
            raise ValueError(f"GGUF has {ROPE_FACTORS[0]} without {ROPE_FACTORS[1]}; convert the model again")
        original = int(get("rope.scaling.original_context_length", None) or max_pos)
        return RopeScaling(rope_type="longrope", factor=max_pos / original, original_max_position_embeddings=original,
                           attention_factor=get("rope.scaling.attn_factor", None),
                           long_factor=_factors(tensors[ROPE_FACTORS[0]]),
                           short_factor=_factors(tensors[ROPE_FACTORS[1]]))
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope.scaling.type {kind!r} is not implemented; tokenmill runs linear, yarn and "
                         "Llama 3's rope_freqs")
    for key, neutral in _YARN_LLAMA_CPP_KEYS.items():
        value = get(f"rope.scaling.{key}", None)
        if value is not None and float(value) != neutral:
            raise ValueError(f"GGUF rope.scaling.{key}={value} is not implemented (tokenmill runs HF's YaRN, which is "
                             f"llama.cpp's with {key} {neutral}); convert the model from its HF folder without it")
    factor = float(get("rope.scaling.factor", 1.0))
    original = get("rope.scaling.original_context_length", None) or max_pos
    return RopeScaling(rope_type=kind, factor=factor, original_max_position_embeddings=int(original),
                       beta_fast=get("rope.scaling.yarn_beta_fast", None),
                       beta_slow=get("rope.scaling.yarn_beta_slow", None),
                       attention_factor=get("rope.scaling.attn_factor", None), truncate=yarn_truncate)
