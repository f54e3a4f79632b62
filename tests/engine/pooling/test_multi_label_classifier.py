"""A multi-label classifier (config.json problem_type "multi_label_classification": independent labels, HF trains
them with BCEWithLogitsLoss) against HF transformers: a tiny random-weight BertForSequenceClassification of 4 labels
saved with save_pretrained beside the MiniLM tokenizer, on 16 real texts: `scores` are the sigmoid of HF's logits
within 1e-5 (fp32), `label` their argmax, `labels` those >= 0.5 in id order; a single-label multi-label head is a
sigmoid too, not a regression."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.outputs import MULTI_LABEL_THRESHOLD

LABELS = {0: "math", 1: "money", 2: "time", 3: "people"}
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _save(hf: torch.nn.Module, folder: Path, minilm_folder: str) -> str:
    hf.save_pretrained(folder)
    for name in _TOKENIZER:
        shutil.copy(Path(minilm_folder) / name, folder / name)
    return str(folder)


def _hf_multi_label(num_labels: int, seed: int, texts: list[str], minilm_folder: str) -> torch.nn.Module:
    """A 2-layer BERT multi-label classifier of random O(1) weights (HF's init, std 0.02, gives logits near 0:
    every probability near 0.5), eval mode; its head bias centres its logits over `texts` (else [CLS], which varies
    little by text, turns on the same labels in every row)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    labels = {i: LABELS[i] for i in range(num_labels)}
    hf = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=96, num_labels=num_labels, id2label=labels,
        label2id={v: k for k, v in labels.items()}, problem_type="multi_label_classification"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.1))
            if name.startswith("classifier."):
                p.mul_(10.0)
        hf.eval()
        tokenizer = AutoTokenizer.from_pretrained(minilm_folder)
        rows = [tokenizer(t, truncation=True, max_length=96)["input_ids"] for t in texts]
        hf.classifier.bias.sub_(torch.cat([hf(input_ids=torch.tensor([r])).logits for r in rows]).mean(0))
    return hf


@pytest.fixture(scope="module")
def texts(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    """16 real texts: GSM8K questions and AlpacaEval instructions alternating."""
    return [t for pair in zip(gsm8k_questions[40:48], alpaca_instructions[40:48], strict=True) for t in pair]


@pytest.fixture(scope="module")
def multi_label(tmp_path_factory: pytest.TempPathFactory, minilm_folder: str,
                texts: list[str]) -> tuple[LLMEngine, torch.nn.Module]:
    """(our engine over the saved folder, the HF model): 4 independent labels."""
    hf = _hf_multi_label(4, 0, texts, minilm_folder)
    folder = _save(hf, tmp_path_factory.mktemp("tiny-multi-label"), minilm_folder)
    return LLMEngine.from_model(folder, EngineConfig(device="cpu", dtype="float32")), hf


def _hf_logits(engine: LLMEngine, hf: torch.nn.Module, texts: list[str]) -> torch.Tensor:
    """HF's logits [len(texts), num_labels] of the texts as our engine tokenizes them, one row per call."""
    rows = [ids for ids, _ in engine.tokenizer.encode_truncated(texts, engine.pooling_runner.max_length)]
    with torch.inference_mode():
        return torch.cat([hf(input_ids=torch.tensor([r])).logits for r in rows]).float()


def test_scores_are_the_sigmoid_of_hf_logits(multi_label: tuple[LLMEngine, torch.nn.Module],
                                            texts: list[str]) -> None:
    engine, hf = multi_label
    assert engine.model_config.multi_label and not engine.model_config.regression
    out = engine.classify(texts)
    probs = torch.sigmoid(_hf_logits(engine, hf, texts)).numpy()
    assert (np.abs(probs - MULTI_LABEL_THRESHOLD) > 1e-3).all()  # no row sits on the cut: `labels` is well defined
    ours = np.stack([o.scores for o in out])
    assert ours.dtype == np.float32 and ours.shape == (len(texts), 4)
    np.testing.assert_allclose(ours, probs, atol=1e-5, rtol=0)
    assert [o.label for o in out] == [LABELS[int(i)] for i in probs.argmax(-1)]
    assert [o.score for o in out] == pytest.approx(probs.max(-1), abs=1e-5)
    expected = [[LABELS[i] for i in range(4) if p[i] >= MULTI_LABEL_THRESHOLD] for p in probs]
    assert [o.labels for o in out] == expected
    counts = {len(labels) for labels in expected}
    assert len(counts) > 1 and max(counts) >= 2  # rows differ, and several labels on at once: a set, not one class


def test_bad_rows_and_single_label_heads(multi_label: tuple[LLMEngine, torch.nn.Module], tmp_path: Path,
                                         minilm_folder: str, texts: list[str]) -> None:
    """An error row has no labels; a softmax head's rows have none either (labels is a multi-label head's); a
    multi-label head of one label is a sigmoid of its logit, not a regression's raw score."""
    engine, _ = multi_label
    bad = engine.classify(["", texts[0]])
    assert bad[0].error and bad[0].labels is None and bad[1].labels is not None
    hf = _hf_multi_label(1, 1, texts[:4], minilm_folder)
    one = LLMEngine.from_model(_save(hf, tmp_path / "one", minilm_folder), EngineConfig(device="cpu",
                                                                                       dtype="float32"))
    out = one.classify(texts[:4])
    probs = torch.sigmoid(_hf_logits(one, hf, texts[:4]))[:, 0].tolist()
    assert [o.score for o in out] == pytest.approx(probs, abs=1e-5)
    assert all(o.label == "math" and o.labels == (["math"] if p >= 0.5 else []) for o, p in zip(out, probs,
                                                                                                  strict=True))
