"""Sequence classifiers (HF `*ForSequenceClassification`: quality / toxicity / domain classifiers, reward models)
from the config alone, no torch: which head a config.json's `architectures` names, its labels and problem type
(ModelConfig.labels / regression / multi_label), and the head's parameter names and shapes (what the registry's
classify entries declare; engine.model.classifier builds the heads).

Heads, as HF transformers' modeling code computes them (models/*/modeling_*.py):
- BertForSequenceClassification: `pooler.dense` + tanh on [CLS], then `classifier` Linear [num_labels, hidden];
- XLMRobertaForSequenceClassification: `classifier.dense` + tanh on <s>, then `classifier.out_proj` (no pooler);
- ModernBertForSequenceClassification: [CLS] or the row's mean (classifier_pooling), then `head` = LayerNorm `norm`
  (no bias) of the exact GELU of `dense` (no bias), then `classifier` Linear [num_labels, hidden];
- LlamaForSequenceClassification / Qwen2ForSequenceClassification: `score` Linear [num_labels, hidden] (no bias) on
  the last token's final hidden state (a row here holds no padding, so its last token is its last non-pad one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.config import ModelConfig
from engine.model.architectures import get_architecture

#: config.json architectures entry -> the registry architecture whose classifier it is.
CLASSIFIER_ARCHITECTURES = {"BertForSequenceClassification": "bert",
                            "XLMRobertaForSequenceClassification": "xlm_roberta",
                            "ModernBertForSequenceClassification": "modernbert",
                            "LlamaForSequenceClassification": "llama", "Qwen2ForSequenceClassification": "qwen2"}
#: problem_type values we run: softmax over the labels (None: HF's default for num_labels > 1), the raw logits
#: (regression), or a sigmoid per label (multi_label_classification; HF trains it with BCEWithLogitsLoss).
_PROBLEM_TYPES = (None, "single_label_classification", "regression", "multi_label_classification")


def classifier_fields(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields `labels` (id2label's names in id order), `regression` and `multi_label` of a config.json
    dict whose `architectures` names a `*ForSequenceClassification`; {} for any other model. regression:
    problem_type "regression", or a single label and no problem_type (HF's rule for num_labels == 1); multi_label:
    problem_type "multi_label_classification" (a sigmoid per label, whatever their number). Raises ValueError
    naming a sequence classifier tokenmill has no head for, a gapped id2label (none at all: LABEL_i from num_labels
    as HF reads it, _id2label), or a problem_type it does not run."""
    names = [a for a in config.get("architectures") or () if str(a).endswith("ForSequenceClassification")]
    if not names:
        return {}
    if CLASSIFIER_ARCHITECTURES.get(names[0]) != arch:
        raise ValueError(f"config.json architectures {names[0]!r}: tokenmill classifies with "
                         f"{sorted(CLASSIFIER_ARCHITECTURES)} only")
    by_id = _id2label(config)
    problem = config.get("problem_type")
    if problem not in _PROBLEM_TYPES:
        raise ValueError(f"config.json problem_type {problem!r} is not run by tokenmill; it runs "
                         f"{list(_PROBLEM_TYPES)}")
    multi = problem == "multi_label_classification"
    return dict(labels=tuple(by_id[i] for i in range(len(by_id))), tie_word_embeddings=False,
                regression=problem == "regression" or (len(by_id) == 1 and problem is None),
                **({"multi_label": True} if multi else {}),
                **(_modernbert_head(config) if arch == "modernbert" else {}))


def _id2label(config: dict[str, Any]) -> dict[int, str]:
    """Label id -> name of a classifier's config.json, read as HF transformers reads it
    (configuration_utils.PretrainedConfig.__init__, 5.x): its id2label; without one, LABEL_0 .. LABEL_{n-1} for
    n = num_labels, or 2 labels where num_labels is absent too (transformers saves neither for its default of 2
    labels named LABEL_i). Raises ValueError for id2label ids other than 0..n-1, a num_labels that is not an
    integer >= 1, or one that disagrees with id2label's length."""
    id2label, num_labels = config.get("id2label"), config.get("num_labels")
    if num_labels is not None and (isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1):
        raise ValueError(f"config.json num_labels must be an integer >= 1, got {num_labels!r}; fix the file")
    if id2label is None or id2label == {}:
        return {i: f"LABEL_{i}" for i in range(2 if num_labels is None else num_labels)}
    if not isinstance(id2label, dict):
        raise ValueError(f"config.json id2label must map label ids to names, got {type(id2label).__name__}")
    try:
        by_id = {int(k): str(v) for k, v in id2label.items()}
    except ValueError as e:
        raise ValueError(f"config.json id2label keys must be label ids 0, 1, ...: {e}") from e
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"config.json id2label ids {sorted(by_id)} are not 0..{len(by_id) - 1}")
    if num_labels is not None and num_labels != len(by_id):
        raise ValueError(f"config.json num_labels {num_labels} disagrees with its id2label of {len(by_id)} labels; "
                         "fix one of them")
    return by_id


def _modernbert_head(config: dict[str, Any]) -> dict[str, Any]:
    """ModernBertForSequenceClassification's head fields (HF ModernBertConfig): classifier_pooling "cls" or "mean"
    (default "cls"). Raises ValueError naming classifier_pooling, classifier_activation (other than "gelu") or
    classifier_bias (true) when set to what tokenmill does not implement."""
    for field, allowed in (("classifier_pooling", ("cls", "mean")), ("classifier_activation", ("gelu",)),
                           ("classifier_bias", (False,))):
        if config.get(field, allowed[0]) not in allowed:
            raise ValueError(f"config.json sets {field}={config[field]!r}, which tokenmill does not implement for a "
                             f"ModernBERT classifier (it runs {field} in {list(allowed)})")
    return {"classifier_pooling": config.get("classifier_pooling", "cls")}


def head_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of each classifier head parameter of `cfg` (module docstring); raises ValueError for an
    architecture without a head."""
    h, n, arch = cfg.hidden_size, len(cfg.labels), get_architecture(cfg.architecture).name
    if arch == "bert":
        return {"pooler.dense.weight": (h, h), "pooler.dense.bias": (h,), "classifier.weight": (n, h),
                "classifier.bias": (n,)}
    if arch == "xlm_roberta":
        return {"classifier.dense.weight": (h, h), "classifier.dense.bias": (h,),
                "classifier.out_proj.weight": (n, h), "classifier.out_proj.bias": (n,)}
    if arch == "modernbert":
        return {"head.dense.weight": (h, h), "head.norm.weight": (h,), "classifier.weight": (n, h),
                "classifier.bias": (n,)}
    if arch in ("llama", "qwen2"):
        return {"score.weight": (n, h)}
    raise ValueError(f"a {cfg.architecture} model has no sequence classification head in tokenmill")


def with_head(body: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
              ) -> Callable[[ModelConfig], dict[str, tuple[int, ...]]]:
    """A classifier's param_shapes: `body`'s (the encoder's or decoder's), its LM head dropped, plus head_shapes."""
    return lambda cfg: {**{k: v for k, v in body(cfg).items() if k != "lm_head.weight"}, **head_shapes(cfg)}
