"""Perplexity of a model on real text: the quality gate to run before trusting a quantized model.

Method (as llama.cpp's perplexity tool, without its "score only the second half" rule): the texts are joined with
blank lines, tokenized once (no chat template), cut into consecutive chunks of at most `context` tokens, and each
chunk is run from an empty KV cache; every token of a chunk but the first is scored by the negative log-likelihood
(natural log) of it given the tokens before it in its chunk. Perplexity = exp(mean NLL). Jelinek et al.,
"Perplexity - a measure of the difficulty of speech recognition tasks" (1977).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.base import ModelBase
from engine.model.sequence_forward import forward_sequence
from engine.text.tokenizer import Tokenizer

_LOGIT_ROWS = 256  # logits are materialized this many rows at a time: [256, vocab] fp32 instead of [context, vocab]


@dataclass(frozen=True)
class PerplexityResult:
    """perplexity: exp(mean NLL); tokens: tokens scored; nll: mean negative log-likelihood in nats per token."""

    perplexity: float
    tokens: int
    nll: float

    def as_dict(self) -> dict[str, float | int]:
        return {"perplexity": self.perplexity, "tokens": self.tokens}


@torch.inference_mode()
def chunk_nll(model: ModelBase, token_ids: torch.Tensor, kv_dtype: torch.dtype) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) of one chunk: token_ids int64 [n] on the model's device, n >= 2."""
    n = token_ids.shape[0]
    hidden = forward_sequence(model, token_ids, kv_dtype)
    total = 0.0
    for start in range(0, n - 1, _LOGIT_ROWS):
        end = min(start + _LOGIT_ROWS, n - 1)
        logits = model.compute_logits(hidden[start:end])
        total += F.cross_entropy(logits, token_ids[start + 1:end + 1], reduction="sum").item()
    return total, n - 1


@torch.inference_mode()
def next_token_logits(model: ModelBase, token_ids: Sequence[int], kv_dtype: torch.dtype | None = None,
                      device: torch.device | None = None) -> torch.Tensor:
    """fp32 [vocab] logits of the token after `token_ids` (n >= 1 tokens), prefilled from an empty private KV cache
    (no scheduler, no batching): the oracle for "was this a tie?" questions about a generated token.
    kv_dtype defaults to the model's dtype; device to the model's device."""
    weight = next(model.parameters())
    device = device or weight.device
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    hidden = forward_sequence(model, ids, kv_dtype or weight.dtype)
    return model.compute_logits(hidden[-1:]).float()[0]


def perplexity(model: ModelBase, token_ids: Sequence[int], context: int = 1024,
               on_chunk: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of `model` on one token stream, scored in chunks of at most `context` tokens (module docstring).

    The model's device and dtype are taken from its parameters; the KV cache uses the dtype of the first plain
    parameter (the norms). on_chunk(tokens_done, tokens_total) reports progress. Raises ValueError when the
    stream has fewer than 2 tokens or `context` is outside [2, the model's max positions].
    """
    if len(token_ids) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(token_ids)}; give more text")
    if not 2 <= context <= model.max_positions:
        raise ValueError(f"context must be in [2, {model.max_positions}] tokens (the model's positions), got "
                         f"{context}")
    param = next(model.parameters())
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=param.device)
    total, count = 0.0, 0
    for start in range(0, len(ids), context):
        chunk = ids[start:start + context]
        if chunk.shape[0] < 2:
            break
        nll, n = chunk_nll(model, chunk, param.dtype)
        total, count = total + nll, count + n
        if on_chunk is not None:
            on_chunk(min(start + context, len(ids)), len(ids))
    mean = total / count
    return PerplexityResult(perplexity=math.exp(mean), tokens=count, nll=mean)


def text_token_ids(tokenizer: Tokenizer, texts: Sequence[str], max_tokens: int | None = None) -> list[int]:
    """Token ids of the non-empty `texts` joined by blank lines, cut to `max_tokens` (None = all).

    Raises ValueError when no text is left."""
    kept = [t for t in texts if isinstance(t, str) and t.strip()]
    if not kept:
        raise ValueError("no non-empty text to score; check the input column")
    ids = tokenizer.encode("\n\n".join(kept))
    return ids if max_tokens is None else ids[:max_tokens]


def text_perplexity(model: ModelBase, tokenizer: Tokenizer, texts: Sequence[str], context: int = 1024,
                    max_tokens: int | None = None,
                    on_chunk: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Perplexity of `model` on `texts` (raw, no chat template); see `perplexity` and `text_token_ids`."""
    return perplexity(model, text_token_ids(tokenizer, texts, max_tokens), context, on_chunk)
