"""Scoring text pairs (LLMEngine.score; vLLM's LLM.score, sentence-transformers' CrossEncoder.predict): one relevance
per (text, text_pair), by either kind of model that can score:

- a cross-encoder, a sequence classifier of one label (engine.pooling.classifier.Classifier; BERT ms-marco-MiniLM,
  XLM-RoBERTa bge-reranker): each pair is one sequence (engine.text.tokenizer.Tokenizer.encode_pairs_truncated:
  [CLS] a [SEP] b [SEP], token type 1 on b for BERT, cut "longest_first" at the row limit, the cut said per row),
  batched longest first within the token budget (engine.pooling.embedder.plan_batches), its one logit through the
  activation sentence-transformers' CrossEncoder.predict applies by default (read_score_activation: Sigmoid for one
  label unless the model's files name Identity);
- an embedding model (engine.pooling.embedder.Embedder): both texts embedded in one call (so they batch together),
  the score the cosine similarity of their embeddings (sentence_transformers.util.cos_sim: each vector
  L2-normalized, then their dot product).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.outputs import ScoreOutput
from engine.pooling.classifier import Classifier
from engine.pooling.embedder import Embedder, plan_batches
from engine.pooling.st_config import _read
from engine.text.prompts import text_problem

#: The activations tokenmill applies to a cross-encoder's logit, by the last part of sentence-transformers' dotted
#: name (torch.nn.modules.activation.Sigmoid, torch.nn.modules.linear.Identity).
ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


def read_score_activation(folder: str) -> str:
    """The activation ("sigmoid" or "identity") sentence-transformers' CrossEncoder applies to the one logit of the
    cross-encoder in `folder` when CrossEncoder(folder).predict is called with its defaults.

    Source: sentence_transformers/cross_encoder/model.py (6.3): the `activation_fn` of config_sentence_transformers.json
    (a CrossEncoder.save of v5 and later), else config.json's `sentence_transformers.activation_fn` (v4) or its
    legacy `sbert_ce_default_activation_function`, else Sigmoid (num_labels 1). Raises ValueError naming the file
    for an activation other than Sigmoid or Identity, or a file that is not JSON."""
    root = Path(folder)
    name, source = None, root / "config_sentence_transformers.json"
    if source.is_file():
        name = _read(source).get("activation_fn")
    if not name and (root / "config.json").is_file():
        source = root / "config.json"
        config = _read(source)
        name = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
            "sbert_ce_default_activation_function")
    if not name:
        return "sigmoid"
    kind = ACTIVATIONS.get(str(name).rsplit(".", 1)[-1]) if str(name).startswith("torch.") else None
    if kind is None:
        raise ValueError(f"{source} names the cross-encoder activation {name!r}; tokenmill scores with "
                         "torch.nn.Sigmoid or torch.nn.Identity only: set activation_fn to one of them")
    return kind


class Scorer:
    """Scores (text, text_pair) pairs with a cross-encoder or an embedding model (module docstring).

    Args:
        runner: the engine's pooling runner: a Classifier of one label (a cross-encoder) or an Embedder.
        activation: a cross-encoder's activation, "sigmoid" or "identity" (read_score_activation); unused by an
            embedding model.

    Raises:
        ValueError: for another activation, or a classifier of more than one label.
    """

    def __init__(self, runner: Embedder, activation: str = "sigmoid") -> None:
        if activation not in ACTIVATIONS.values():
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS.values())}, got {activation!r}")
        self.cross = isinstance(runner, Classifier)
        if self.cross and len(runner.model.config.labels) != 1:
            raise ValueError(f"a classifier of {len(runner.model.config.labels)} labels cannot score pairs; a "
                             "cross-encoder has one")
        self.runner = runner
        self.activation = activation

    def score(self, texts: Sequence[object], text_pairs: Sequence[object],
              request_ids: Sequence[str] | None = None) -> list[ScoreOutput]:
        """One ScoreOutput per (texts[i], text_pairs[i]), in order (engine.outputs.ScoreOutput: float score, tokens
        read, truncated). A pair whose text or text_pair is not a string, or is empty or only whitespace, gets an
        error output naming the column and the others still run. Raises ValueError when texts, text_pairs and
        request_ids differ in length, or without a tokenizer."""
        runner = self.runner
        if runner.tokenizer is None:
            raise ValueError("this engine has no tokenizer (random weights); build it with one to score texts")
        ids = [str(i) for i in range(len(texts))] if request_ids is None else [str(r) for r in request_ids]
        if not len(texts) == len(text_pairs) == len(ids):
            raise ValueError(f"score got {len(texts)} texts, {len(text_pairs)} text pairs and {len(ids)} request "
                             "ids; give one text pair and one id per text")
        out: list[ScoreOutput | None] = [None] * len(texts)
        good: list[int] = []
        for i, pair in enumerate(zip(texts, text_pairs, strict=True)):
            problems = [f"{col}: {p}" for col, p in zip(("text", "text_pair"), map(text_problem, pair), strict=True)
                        if p is not None]
            if problems:
                out[i] = ScoreOutput(ids[i], None, 0, error="; ".join(problems))
            else:
                good.append(i)
        firsts, seconds = [str(texts[i]) for i in good], [str(text_pairs[i]) for i in good]
        scored = self._cross_encode(firsts, seconds) if self.cross else self._cosine(firsts, seconds)
        for i, (score, tokens, cut) in zip(good, scored, strict=True):
            out[i] = ScoreOutput(ids[i], score, tokens, truncated=cut)
        return [o for o in out if o is not None]

    def token_counts(self, texts: Sequence[object], text_pairs: Sequence[object]) -> list[int]:
        """Tokens each (texts[i], text_pairs[i]) would be scored with, as `score` counts them (ScoreOutput's
        num_prompt_tokens), tokenized only, no forward: a cross-encoder's pair as one sequence cut at the row limit
        ([CLS] a [SEP] b [SEP]), an embedding model's two texts each as it embeds them (each cut at the limit).
        0 for a pair `score` makes an error output of (either text not a string, empty or only whitespace). Raises
        ValueError when texts and text_pairs differ in length, or without a tokenizer."""
        runner = self.runner
        if runner.tokenizer is None:
            raise ValueError("this engine has no tokenizer (random weights); build it with one to count tokens")
        if len(texts) != len(text_pairs):
            raise ValueError(f"{len(texts)} texts but {len(text_pairs)} text pairs; give one pair per text")
        good = [i for i, pair in enumerate(zip(texts, text_pairs, strict=True))
                if text_problem(pair[0]) is None and text_problem(pair[1]) is None]
        counts = [0] * len(texts)
        firsts, seconds = [str(texts[i]) for i in good], [str(text_pairs[i]) for i in good]
        if self.cross and good:
            encoded = runner.tokenizer.encode_pairs_truncated(firsts, seconds, runner.max_length)
            lengths = [len(ids) for ids, _, _ in encoded]
        else:
            lengths = [a + b for a, b in zip(runner.token_counts(firsts), runner.token_counts(seconds), strict=True)]
        for i, n in zip(good, lengths, strict=True):
            counts[i] = n
        return counts

    def _cross_encode(self, firsts: list[str], seconds: list[str]) -> list[tuple[float, int, bool]]:
        """(score, tokens, truncated) of each pair through the cross-encoder."""
        runner = self.runner
        if not firsts:
            return []
        encoded = runner.tokenizer.encode_pairs_truncated(firsts, seconds, runner.max_length)  # type: ignore[union-attr]
        logits = torch.zeros(len(encoded), dtype=torch.float32)
        segments = runner.model.config.type_vocab_size > 1  # BERT; XLM-RoBERTa has one token type, decoders none
        for batch in plan_batches([len(e[0]) for e in encoded], runner.max_batch_tokens, runner.max_batch_rows):
            types = [encoded[j][1] for j in batch]
            # NOTE: the runner's own forward and lock (one forward at a time per engine); token types only where a
            # second segment has them, so a model without segments runs exactly as classify does.
            with runner._forward_lock:
                run = runner._run([encoded[j][0] for j in batch], None,  # type: ignore[call-arg]
                                  types if segments and any(any(t) for t in types) else None)
            logits[batch] = torch.from_numpy(run[:, 0])
        scores = torch.sigmoid(logits) if self.activation == "sigmoid" else logits
        return [(float(s), len(ids), cut) for s, (ids, _, cut) in zip(scores.tolist(), encoded, strict=True)]

    def _cosine(self, firsts: list[str], seconds: list[str]) -> list[tuple[float, int, bool]]:
        """(cosine similarity, both texts' tokens, either truncated) of each pair through the embedding model."""
        n = len(firsts)
        rows = self.runner.embed(firsts + seconds) if n else []
        if not rows:
            return []
        vectors = F.normalize(torch.from_numpy(np.stack([r.embedding for r in rows])), p=2, dim=-1)
        cosines = (vectors[:n] * vectors[n:]).sum(-1).tolist()
        return [(c, a.num_prompt_tokens + b.num_prompt_tokens, a.truncated or b.truncated)
                for c, a, b in zip(cosines, rows[:n], rows[n:], strict=True)]
