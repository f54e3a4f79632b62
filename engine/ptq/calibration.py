"""Calibration text for GPTQ and the end-to-end tuning: token-id batches cut from real text.

Both passes run the model over int64 [S, L] sequences from position 0, each in its own private KV cache
(engine.model.sequence_forward). Use text that is not the evaluation text: the defaults mix GSM8K questions and answers
with AlpacaEval instructions, and the perplexity gate scores AlpacaEval reference answers (bench/README.md, INT4).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def calibration_token_ids(tokenizer: object, texts: Sequence[str], num_sequences: int,
                          seq_len: int) -> torch.Tensor:
    """int64 [S, seq_len] calibration batch: the non-empty `texts` joined by blank lines, tokenized once (as
    engine.model.perplexity does) and cut into consecutive sequences of `seq_len` tokens, S = min(num_sequences, what
    the
    text fills). Raises ValueError when the text does not fill one sequence."""
    from engine.model.perplexity import text_token_ids

    ids = text_token_ids(tokenizer, texts, num_sequences * seq_len)  # type: ignore[arg-type]
    s = len(ids) // seq_len
    if s == 0:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one sequence of {seq_len}")
    return torch.tensor(ids[:s * seq_len], dtype=torch.int64).view(s, seq_len)


def calibration_batch(tokenizer: object, sources: Sequence[Sequence[str]], num_sequences: int,
                      seq_len: int) -> torch.Tensor:
    """int64 [S, seq_len]: num_sequences split evenly over `sources` (each a list of texts; the first sources get
    the remainder), each part cut by calibration_token_ids, concatenated. A mix of domains generalizes better than
    one: on SmolLM2-135M layer 0, GSM8K-only calibration made GPTQ worse than round-to-nearest on AlpacaEval
    answers, GSM8K + AlpacaEval instructions made it better (bench/README.md, INT4). Raises ValueError for no
    sources or a source too short for one sequence."""
    if not sources:
        raise ValueError("no calibration text given")
    parts = []
    for i, texts in enumerate(sources):
        n = num_sequences // len(sources) + (1 if i < num_sequences % len(sources) else 0)
        if n:
            parts.append(calibration_token_ids(tokenizer, texts, n, seq_len))
    return torch.cat(parts)
