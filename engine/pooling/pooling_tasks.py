"""LLMEngine's tasks beyond generation: embed, classify and score, a base class of engine.llm_engine.LLMEngine (which
builds the runners: `pooling_runner`, an Embedder or a Classifier, and `scorer`), so that module keeps to
generation. Each method refuses a model that cannot do its task (engine.model.registry.refuse_task: one line naming
what the model does) and hands the texts to its runner in engine.pooling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.model.registry import refuse_task
from engine.pooling.embed_options import EmbedOptions

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.outputs import ClassificationOutput, EmbeddingOutput, ScoreOutput
    from engine.pooling.embedder import Embedder
    from engine.pooling.scorer import Scorer


class PoolingTasks:
    """embed / classify / score over the engine's `pooling_runner` and `scorer` (None for a model without them)."""

    model_config: ModelConfig
    pooling_runner: Embedder | None
    scorer: Scorer | None

    def embed(self, texts: Sequence[str], *, request_ids: Sequence[str] | None = None, dimensions: int | None = None,
              normalize: bool = False, prefix: str = "", truncate: bool = True) -> list[EmbeddingOutput]:
        """One EmbeddingOutput per text, in order (engine.pooling.embedder.Embedder.embed; the keywords are
        engine.pooling.embed_options.EmbedOptions'). Raises ValueError for a model that does not embed, texts and
        request_ids of other lengths, or options out of range (dimensions < 1 or over the model's width)."""
        refuse_task(self.model_config, "embed")
        options = EmbedOptions(dimensions=dimensions, normalize=normalize, prefix=prefix, truncate=truncate)
        return self.pooling_runner.embed(texts, request_ids, options)  # type: ignore[union-attr]

    def classify(self, texts: Sequence[str], request_ids: Sequence[str] | None = None) -> list[ClassificationOutput]:
        """One ClassificationOutput per text, in order (engine.pooling.classifier.Classifier.classify). Raises
        ValueError for a model that does not classify (not a *ForSequenceClassification) or as Classifier.classify."""
        refuse_task(self.model_config, "classify")
        return self.pooling_runner.classify(texts, request_ids)  # type: ignore[union-attr]

    def score(self, texts: Sequence[str], text_pairs: Sequence[str],
              request_ids: Sequence[str] | None = None) -> list[ScoreOutput]:
        """One ScoreOutput per (texts[i], text_pairs[i]), in order: a cross-encoder's relevance (sigmoid of its logit,
        as sentence-transformers' CrossEncoder.predict by default) or an embedding model's cosine similarity
        (engine.pooling.scorer.Scorer.score; a bad text in either column is an error output, the others go on).
        Raises ValueError for a model that cannot score (a causal LM, a classifier of several labels) or as
        Scorer.score (lengths that differ)."""
        refuse_task(self.model_config, "score")
        return self.scorer.score(texts, text_pairs, request_ids)  # type: ignore[union-attr]
