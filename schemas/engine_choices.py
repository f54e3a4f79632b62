"""The engine's choices, defined once: the names and defaults engine.EngineConfig accepts and the job spec's `engine`
section (schemas.spec_sections.Engine) offers, so a value is accepted or refused alike wherever it is written (as
schemas.sampling is for the sampling ranges). Plain Python (no torch): schemas is the bottom layer.

What each choice means is documented where it acts: engine.config.EngineConfig (every field),
engine.loading.quantized (the quantization modes), engine.worker.model_runner.select_attention (the backends).
"""

from __future__ import annotations

from collections.abc import Sequence

# Activation, weight and KV cache dtype ("auto": bf16 on CUDA and on CPUs with native bf16, else fp32).
DTYPES = ("auto", "float32", "bfloat16", "float16")
# How weights are held: dequantized, INT4 where stored so, INT4 everywhere, W8A8 on the CPU.
QUANTIZATIONS = ("none", "auto", "int4", "int8")
# Input features per INT4 scale/zero group: the sizes tinygemm (_weight_int4pack_mm) packs.
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP_SIZE = 128
# Paged-attention kernels: auto, Triton, the C++ CPU kernel, the torch reference.
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
# What a job asks of the model: a completion per row (a causal LM), an embedding per row (an encoder), a label per
# row (a *ForSequenceClassification model), or a relevance per (text, text pair) row (a cross-encoder, or an
# embedding model's cosine).
TASKS = ("generate", "embed", "classify", "score")
# The element types of an embed job's `embedding` column (the engine computes float32; float16 halves the bytes).
EMBEDDING_DTYPES = ("float32", "float16")
# Most requests decoding at once per engine.
DEFAULT_MAX_NUM_SEQS = 256


def one_of(choices: Sequence[object]) -> str:
    """The choices in words: "a, b or c"."""
    words = [str(c) for c in choices]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def choice_problem(name: str, value: object, choices: Sequence[object]) -> str | None:
    """One line naming the choices when `value` is not one of them, of the same type (e.g. "dtype must be auto,
    float32, bfloat16 or float16, got 'fp8'"; 128.0 or True is no group size); None when it is."""
    if any(value == c and type(value) is type(c) for c in choices):
        return None
    return f"{name} must be {one_of(choices)}, got {value!r}"
