"""Sequence classifiers (LLMEngine.classify; engine.model.classifier) against HF transformers' own
*ForSequenceClassification: tiny random-weight BERT, XLM-RoBERTa, ModernBERT ([CLS] and mean pooling), Llama and
Qwen2 classifiers (3 labels) saved with save_pretrained beside the MiniLM tokenizer, loaded by LLMEngine from the
folder, on real texts (some over the row limit: truncated alike): logits within 1e-4 in fp32, softmax scores, labels
= HF's argmax. Bad rows are error outputs; a classifier refuses generate / embed, a plain encoder or decoder refuses
classify. Rows run in batches of mixed lengths (one batch, and several under a small token budget)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.pooling.embedder import plan_batches

LABELS = {0: "low", 1: "medium", 2: "high"}
MAX_POSITIONS = 96  # below the tokenizer's 512: the longer texts are cut at the model's row limit
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _hf_classifier(kind: str, texts: list[str], tokenizer: object) -> torch.nn.Module:
    """A tiny HF *ForSequenceClassification of random O(1) weights (HF's init, std 0.02, would give near-equal
    logits), eval mode; an encoder's head bias centres its logits over `texts` (else one label wins every row)."""
    import transformers as tf

    common = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    if kind == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(**common, max_position_embeddings=MAX_POSITIONS))
    elif kind == "xlm_roberta":  # its positions start at pad_token_id + 1 = 2: rows of up to MAX_POSITIONS - 2
        model = tf.XLMRobertaForSequenceClassification(tf.XLMRobertaConfig(
            **common, max_position_embeddings=MAX_POSITIONS, type_vocab_size=1, pad_token_id=1))
    elif kind.startswith("modernbert"):  # global, local, local, global; a window of 8 each side; "_mean" pools
        model = tf.ModernBertForSequenceClassification(tf.ModernBertConfig(  # the mean of the row's tokens
            **{**common, "intermediate_size": 96, "num_hidden_layers": 4}, max_position_embeddings=MAX_POSITIONS,
            global_attn_every_n_layers=3, local_attention=16, pad_token_id=0, bos_token_id=101, eos_token_id=102,
            cls_token_id=101, sep_token_id=102, classifier_pooling="mean" if kind.endswith("_mean") else "cls"))
    elif kind == "llama":
        model = tf.LlamaForSequenceClassification(tf.LlamaConfig(**common, num_key_value_heads=2,
                                                                 max_position_embeddings=MAX_POSITIONS))
    else:
        model = tf.Qwen2ForSequenceClassification(tf.Qwen2Config(**common, num_key_value_heads=2,
                                                                 max_position_embeddings=MAX_POSITIONS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name.lower() or p.dim() == 1 else 0.1))
            if name.startswith("classifier."):  # an encoder's [CLS] varies little by text: a wider head
                p.mul_(10.0)
        model.eval()
        if kind != "llama" and kind != "qwen2":
            rows = [tokenizer(t, truncation=True, max_length=64)["input_ids"] for t in texts]  # type: ignore[operator]
            logits = torch.cat([model(input_ids=torch.tensor([r])).logits for r in rows])
            bias = model.classifier.out_proj.bias if kind == "xlm_roberta" else model.classifier.bias
            bias.sub_(logits.mean(0))
    return model


@pytest.fixture(scope="module", params=["bert", "xlm_roberta", "modernbert", "modernbert_mean", "llama", "qwen2"])
def classifier(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, minilm_folder: str,
               texts: list[str]) -> tuple[LLMEngine, torch.nn.Module]:
    """(our engine over the saved folder, the HF model) of one family."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    hf = _hf_classifier(request.param, texts, AutoTokenizer.from_pretrained(minilm_folder))
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}-classifier")
    hf.save_pretrained(folder)
    for name in _TOKENIZER:
        shutil.copy(Path(minilm_folder) / name, folder / name)
    return LLMEngine.from_model(str(folder), EngineConfig(device="cpu", dtype="float32")), hf


@pytest.fixture(scope="module")
def texts(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    """16 real texts of about 10 to over 96 tokens."""
    return [t for pair in zip(gsm8k_questions[:8], alpaca_instructions[180:188], strict=True) for t in pair]


def test_logits_and_labels_equal_hf(classifier: tuple[LLMEngine, torch.nn.Module], texts: list[str]) -> None:
    engine, hf = classifier
    out = engine.classify(texts)
    limit = engine.pooling_runner.max_length
    rows = [ids for ids, _ in engine.tokenizer.encode_truncated(texts, limit)]
    assert any(len(r) == limit for r in rows) and min(len(r) for r in rows) < limit // 2  # some cut, some not
    with torch.inference_mode():  # one row per call: no padding for HF to mask
        theirs = torch.cat([hf(input_ids=torch.tensor([r])).logits for r in rows]).float()
    probs = torch.softmax(theirs, -1).numpy()
    ours = np.stack([o.scores for o in out])
    assert ours.dtype == np.float32 and ours.shape == (len(texts), 3)
    np.testing.assert_allclose(ours, probs, atol=1e-4, rtol=0)
    logits = engine.pooling_runner._run(rows, None)  # the head's raw logits (Classifier.classify softmaxes them)
    torch.testing.assert_close(torch.from_numpy(logits), theirs, atol=1e-4, rtol=0)
    assert [o.label for o in out] == [LABELS[int(i)] for i in theirs.argmax(-1)]
    assert len({o.label for o in out}) > 1  # the labels are not all one: argmax is really compared
    assert [o.score for o in out] == pytest.approx(probs.max(-1), abs=1e-4)
    assert [o.num_prompt_tokens for o in out] == [len(r) for r in rows]
    assert [o.truncated for o in out] == [len(r) > limit for r in engine.tokenizer.hf_tokenizer(texts)["input_ids"]]
    assert [o.request_id for o in out] == [str(i) for i in range(len(texts))]


def test_small_batches_of_mixed_lengths_equal_hf(classifier: tuple[LLMEngine, torch.nn.Module],
                                                 texts: list[str]) -> None:
    """A small token budget: several batches, each of rows of mixed lengths in one packed forward (a decoder's
    causal within each row: engine.model.packed_forward), against HF one row per call."""
    engine, hf = classifier
    budget, most = 300, 5
    small = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=budget,
                                            max_num_seqs=most))
    rows = [ids for ids, _ in engine.tokenizer.encode_truncated(texts, engine.pooling_runner.max_length)]
    batches = plan_batches([len(r) for r in rows], budget, most)
    assert len(batches) > 2 and sum(len({len(rows[i]) for i in b}) > 1 for b in batches) > 2
    with torch.inference_mode():
        theirs = torch.cat([hf(input_ids=torch.tensor([r])).logits for r in rows]).float()
    ours = torch.zeros_like(theirs)
    for b in batches:
        ours[b] = torch.from_numpy(small.pooling_runner._run([rows[i] for i in b], None))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    out = small.classify(texts)
    assert [o.label for o in out] == [LABELS[int(i)] for i in theirs.argmax(-1)]
    np.testing.assert_allclose(np.stack([o.scores for o in out]), torch.softmax(theirs, -1).numpy(), atol=1e-4)


def test_bad_rows_are_error_outputs(classifier: tuple[LLMEngine, torch.nn.Module], texts: list[str]) -> None:
    engine, _ = classifier
    out = engine.classify(["", texts[0], 7, "   "], request_ids=["a", "b", "c", "d"])  # type: ignore[list-item]
    assert [o.request_id for o in out] == ["a", "b", "c", "d"]
    assert [o.error is None for o in out] == [False, True, False, False]
    assert all(o.label is None and o.scores is None for o in out if o.error)
    assert out[1].label in LABELS.values()


def test_a_classifier_refuses_generate_and_embed(classifier: tuple[LLMEngine, torch.nn.Module]) -> None:
    engine, _ = classifier
    with pytest.raises(ValueError, match="cannot embed.*classify"):
        engine.embed(["a text"])
    with pytest.raises(ValueError, match="cannot generate.*classify"):
        engine.generate(["a text"])


def test_a_plain_encoder_or_decoder_refuses_classify(minilm_folder: str) -> None:
    for engine in (LLMEngine.from_model(minilm_folder, EngineConfig(device="cpu", dtype="float32")),
                   LLMEngine.from_config("tiny", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))):
        with pytest.raises(ValueError, match="cannot classify"):
            engine.classify(["a text"])


def test_a_regression_head_gives_raw_scores(tmp_path: Path, minilm_folder: str, texts: list[str]) -> None:
    """A single-label head (a reward model's): no label, score = HF's raw logit, scores = [logit]."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(1)
    hf = BertForSequenceClassification(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=64,
                                                  max_position_embeddings=MAX_POSITIONS, num_labels=1)).eval()
    hf.save_pretrained(tmp_path)
    for name in _TOKENIZER:
        shutil.copy(Path(minilm_folder) / name, tmp_path / name)
    engine = LLMEngine.from_model(str(tmp_path), EngineConfig(device="cpu", dtype="float32"))
    out = engine.classify(texts[:4])
    rows = [ids for ids, _ in engine.tokenizer.encode_truncated(texts[:4], engine.pooling_runner.max_length)]
    with torch.inference_mode():
        theirs = [float(hf(input_ids=torch.tensor([r])).logits[0, 0]) for r in rows]
    assert all(o.label is None and o.scores.shape == (1,) for o in out)
    assert [o.score for o in out] == pytest.approx(theirs, abs=1e-4)
