"""engine.model.classifier_names.classifier_fields: a config.json's *ForSequenceClassification becomes
ModelConfig.labels / regression / multi_label, or a ValueError naming what
tokenmill does not run."""

from __future__ import annotations

import pytest

from engine.model.classifier_names import classifier_fields

BERT = {"architectures": ["BertForSequenceClassification"], "id2label": {"1": "toxic", "0": "clean"}}


def test_labels_in_id_order_and_regression() -> None:
    assert classifier_fields(BERT, "bert") == dict(labels=("clean", "toxic"), regression=False,
                                                   tie_word_embeddings=False)
    assert classifier_fields({**BERT, "problem_type": "regression"}, "bert")["regression"] is True
    assert classifier_fields({**BERT, "id2label": {"0": "reward"}}, "bert")["regression"] is True  # one label
    assert classifier_fields({"architectures": ["BertModel"]}, "bert") == {}  # not a classifier
    multi = classifier_fields({**BERT, "problem_type": "multi_label_classification"}, "bert")
    assert (multi["multi_label"], multi["regression"]) == (True, False)
    one = classifier_fields({**BERT, "id2label": {"0": "toxic"}, "problem_type": "multi_label_classification"}, "bert")
    assert (one["multi_label"], one["regression"]) == (True, False)  # a sigmoid of one logit, not a raw score


@pytest.mark.parametrize(("change", "named"), [
    ({"id2label": None}, "id2label"), ({"id2label": {"0": "a", "2": "b"}}, "id2label ids"),
    ({"problem_type": "ordinal_regression"}, "ordinal_regression"),
    ({"architectures": ["GemmaForSequenceClassification"]}, "GemmaForSequenceClassification")])
def test_what_tokenmill_does_not_run_is_named(change: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        classifier_fields({**BERT, **change}, "bert")
