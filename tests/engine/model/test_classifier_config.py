"""engine.model.classifier_names.classifier_fields: a config.json's *ForSequenceClassification becomes
ModelConfig.labels / regression / multi_label (LABEL_i without id2label, as HF reads it), or a ValueError naming what
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


def test_no_id2label_reads_as_hf_does() -> None:
    """transformers 5 saves no id2label for labels named LABEL_i (nor num_labels for its default of 2): the labels
    are LABEL_0 .. LABEL_{num_labels - 1}, 2 without num_labels, as PretrainedConfig reads them."""
    bare = {"architectures": ["BertForSequenceClassification"]}
    assert classifier_fields({**bare, "num_labels": 3}, "bert")["labels"] == ("LABEL_0", "LABEL_1", "LABEL_2")
    assert classifier_fields(bare, "bert")["labels"] == ("LABEL_0", "LABEL_1")
    assert classifier_fields({**bare, "id2label": {}, "num_labels": 1}, "bert")["regression"] is True
    assert classifier_fields({**BERT, "num_labels": 2}, "bert")["labels"] == ("clean", "toxic")  # they agree


@pytest.mark.parametrize(("change", "named"), [
    ({"id2label": {"0": "a", "2": "b"}}, "id2label ids"), ({"num_labels": 3}, "num_labels 3 disagrees"),
    ({"id2label": None, "num_labels": 0}, "num_labels must be an integer >= 1"),
    ({"problem_type": "ordinal_regression"}, "ordinal_regression"),
    ({"architectures": ["GemmaForSequenceClassification"]}, "GemmaForSequenceClassification")])
def test_what_tokenmill_does_not_run_is_named(change: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        classifier_fields({**BERT, **change}, "bert")
