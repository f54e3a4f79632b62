"""Sequence classification (LLMEngine.classify): an Embedder (engine.pooling.embedder: the same text checks,
tokenization, truncation and token-budget batches) whose per-row vector is the classifier head's logits
(engine.model.classifier: `classify_logits`) instead of a pooled embedding, turned into labels and scores.

Each batch is one packed forward (Embedder._hidden): an encoder's attends both ways within each row, a causal
decoder's (Llama / Qwen2 reward models and classifiers) causally within each row with no KV cache kept
(engine.model.packed_forward), its last token scored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.outputs import MULTI_LABEL_THRESHOLD, ClassificationOutput
from engine.pooling.embed_options import EmbedOptions
from engine.pooling.embedder import Embedder


class Classifier(Embedder):
    """A sequence classifier model (task "classify"), its tokenizer and its labels: `classify(texts)`. Built as
    Embedder (its `pooling` only gives the row limit, max_seq_length)."""

    def classify(self, texts: Sequence[object], request_ids: Sequence[str] | None = None
                 ) -> list[ClassificationOutput]:
        """One ClassificationOutput per text, in order: label and score of the softmax over the logits; a
        multi-label head's sigmoid per label, its top label and the list of those >= MULTI_LABEL_THRESHOLD; or the
        raw logits of a regression head (engine.outputs.ClassificationOutput). A text that is not a string, or is empty
        or only whitespace, gets an error output and the others still run; a text over the row limit is truncated
        (truncated=True). Raises ValueError when request_ids and texts differ in length, or without a tokenizer."""
        cfg = self.model.config
        out = []
        for row in self.embed(texts, request_ids):
            if row.embedding is None:
                out.append(ClassificationOutput(row.request_id, None, None, None, 0, error=row.error))
                continue
            logits = row.embedding
            if cfg.regression:
                out.append(ClassificationOutput(row.request_id, None, float(logits[0]), logits,
                                                row.num_prompt_tokens, row.truncated))
                continue
            if cfg.multi_label:  # independent labels (HF: BCEWithLogitsLoss): a sigmoid each
                probs = torch.sigmoid(torch.from_numpy(logits)).numpy()
                on = [name for name, p in zip(cfg.labels, probs, strict=True) if p >= MULTI_LABEL_THRESHOLD]
            else:
                probs, on = torch.softmax(torch.from_numpy(logits), dim=-1).numpy(), None
            best = int(np.argmax(probs))
            out.append(ClassificationOutput(row.request_id, cfg.labels[best], float(probs[best]), probs,
                                            row.num_prompt_tokens, row.truncated, labels=on))
        return out

    @torch.inference_mode()
    def _run(self, rows: list[list[int]], options: EmbedOptions | None,
             token_types: list[list[int]] | None = None) -> np.ndarray:
        """float32 [len(rows), num_labels] logits of token-id rows (options unused: classify takes none);
        token_types: each row's token type ids (a cross-encoder's pair: engine.pooling.scorer), read by an
        encoder (a causal decoder has none); None: 0 everywhere."""
        logits = self.model.classify_logits(self._hidden(rows, token_types),  # type: ignore[operator]
                                            [len(r) for r in rows])
        return logits.cpu().numpy()
