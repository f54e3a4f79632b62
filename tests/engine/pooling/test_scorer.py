"""LLMEngine.score (engine.pooling.scorer) on real (text, text pair) rows, 12 pairs: GSM8K (question, answer),
AlpacaEval (instruction, reference output) and two GSM8K questions, some past the row limit.

- a tiny random BERT cross-encoder (BertForSequenceClassification, 1 label, saved beside the MiniLM tokenizer)
  against sentence-transformers' CrossEncoder(folder).predict (its default Sigmoid) and HF's own logits with the
  pair's token types, within 1e-5 in fp32; the same truncation ("longest_first"), reported per row; the token types
  are really read (without them the scores differ); Identity from the model's files gives the raw logits;
- a tiny XLM-RoBERTa cross-encoder (one token type) against HF's logits;
- the default embedding model (all-MiniLM-L6-v2): the cosine of sentence-transformers' embeddings, within 1e-5;
- bad texts in either column are error outputs naming the column; a causal LM refuses score.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.pooling.scorer import Scorer, read_score_activation

FP32 = EngineConfig(device="cpu", dtype="float32")
MAX_POSITIONS = 128
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


@pytest.fixture(scope="module")
def pairs(data_dir: Path) -> tuple[list[str], list[str]]:
    gsm = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question", "answer"]).slice(40, 8).to_pylist()
    alpaca = pq.read_table(data_dir / "alpaca_eval.parquet", columns=["instruction", "reference_output"]
                           ).slice(60, 4).to_pylist()
    firsts = [r["question"] for r in gsm[:4]] + [r["instruction"] for r in alpaca] + [r["question"] for r in gsm[4:]]
    seconds = ([r["answer"] for r in gsm[:4]] + [r["reference_output"] for r in alpaca]
               + [r["question"] for r in gsm[3:7]])
    return firsts, seconds


def _cross_encoder(kind: str, folder: Path, minilm_folder: str, pairs: tuple[list[str], list[str]]) -> torch.nn.Module:
    """A tiny HF cross-encoder (1 label) of random O(1) weights, its bias centring its logits over `pairs` (so the
    sigmoid is not flat), saved with the MiniLM tokenizer into `folder`."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=MAX_POSITIONS, num_labels=1)
    model = (tf.BertForSequenceClassification(tf.BertConfig(**common)) if kind == "bert" else
             tf.XLMRobertaForSequenceClassification(tf.XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=1)))
    tok = tf.AutoTokenizer.from_pretrained(minilm_folder)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name.lower() or p.dim() == 1 else 0.1))
            if name.startswith("classifier."):
                p.mul_(40.0)  # wide enough that the scores spread over the sigmoid
        model.eval()
        logits = torch.cat([_hf_logits(model, tok, a, b, kind == "bert") for a, b in zip(*pairs, strict=True)])
        (model.classifier.bias if kind == "bert" else model.classifier.out_proj.bias).sub_(logits.mean())
    model.save_pretrained(folder)
    for name in _TOKENIZER:
        shutil.copy(Path(minilm_folder) / name, folder / name)
    return model


def _hf_logits(model: torch.nn.Module, tok: object, a: str, b: str, types: bool) -> torch.Tensor:
    """HF's logit [1, 1] of one pair (one row per call: no padding), with the pair's token types or none."""
    enc = tok(a, b, truncation=True, max_length=model.config.max_position_embeddings - (0 if types else 2),
              return_tensors="pt")  # type: ignore[operator]
    extra = {"token_type_ids": enc["token_type_ids"]} if types else {}
    return model(input_ids=enc["input_ids"], **extra).logits


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory, minilm_folder: str,
         pairs: tuple[list[str], list[str]]) -> tuple[str, torch.nn.Module, LLMEngine]:
    folder = tmp_path_factory.mktemp("tiny-cross-encoder")
    hf = _cross_encoder("bert", folder, minilm_folder, pairs)
    return str(folder), hf, LLMEngine.from_model(str(folder), FP32)


def test_a_cross_encoder_scores_as_sentence_transformers(bert: tuple[str, torch.nn.Module, LLMEngine],
                                                         pairs: tuple[list[str], list[str]]) -> None:
    from sentence_transformers import CrossEncoder

    folder, hf, engine = bert
    out = engine.score(*pairs)
    ours = np.array([o.score for o in out])
    theirs = CrossEncoder(folder, device="cpu").predict(list(zip(*pairs, strict=True)))
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert ours.std() > 0.05  # the scores spread: a flat sigmoid would compare nothing
    tok = engine.tokenizer.hf_tokenizer
    with torch.inference_mode():
        logits = torch.cat([_hf_logits(hf, tok, a, b, True) for a, b in zip(*pairs, strict=True)])[:, 0]
        untyped = torch.cat([_hf_logits(hf, tok, a, b, False) for a, b in zip(*pairs, strict=True)])[:, 0]
    np.testing.assert_allclose(ours, torch.sigmoid(logits).numpy(), atol=1e-5, rtol=0)
    assert np.abs(ours - torch.sigmoid(untyped).numpy()).max() > 1e-3  # the second segment's token type is read
    kept = tok(*pairs, truncation=True, max_length=MAX_POSITIONS)["input_ids"]
    cut = [len(w) > MAX_POSITIONS for w in tok(*pairs)["input_ids"]]
    assert [o.num_prompt_tokens for o in out] == [len(k) for k in kept]
    assert [o.truncated for o in out] == cut and 0 < sum(cut) < len(cut)
    assert [o.request_id for o in out] == [str(i) for i in range(len(out))] and all(o.error is None for o in out)
    raw = Scorer(engine.pooling_runner, "identity").score(*pairs)  # Identity: the raw logits
    np.testing.assert_allclose([o.score for o in raw], logits.numpy(), atol=1e-5, rtol=0)


def test_an_xlm_roberta_cross_encoder_scores_as_hf(tmp_path: Path, minilm_folder: str,
                                                   pairs: tuple[list[str], list[str]]) -> None:
    hf = _cross_encoder("xlm_roberta", tmp_path, minilm_folder, pairs)
    engine = LLMEngine.from_model(str(tmp_path), FP32)
    with torch.inference_mode():
        logits = torch.cat([_hf_logits(hf, engine.tokenizer.hf_tokenizer, a, b, False)
                            for a, b in zip(*pairs, strict=True)])[:, 0]
    np.testing.assert_allclose([o.score for o in engine.score(*pairs)], torch.sigmoid(logits).numpy(), atol=1e-5)


def test_the_activation_is_the_one_sentence_transformers_reads(tmp_path: Path) -> None:
    assert read_score_activation(str(tmp_path)) == "sigmoid"  # no file names one: Sigmoid for one label
    (tmp_path / "config.json").write_text(json.dumps(
        {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}))
    assert read_score_activation(str(tmp_path)) == "identity"
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"activation_fn": "torch.nn.modules.activation.Sigmoid"}))
    assert read_score_activation(str(tmp_path)) == "sigmoid"  # the sentence-transformers config wins
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"activation_fn": "torch.nn.Tanh"}))
    with pytest.raises(ValueError, match="Sigmoid or torch.nn.Identity only"):
        read_score_activation(str(tmp_path))


def test_an_embedding_model_scores_the_cosine_of_sentence_transformers(minilm_folder: str,
                                                                       pairs: tuple[list[str], list[str]]) -> None:
    from sentence_transformers import SentenceTransformer

    engine = LLMEngine.from_model(minilm_folder, FP32)
    out = engine.score(*pairs)
    st = SentenceTransformer(minilm_folder, device="cpu")
    a, b = (st.encode(texts, convert_to_numpy=True) for texts in pairs)
    cosines = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    np.testing.assert_allclose([o.score for o in out], cosines, atol=1e-5, rtol=0)
    tok = engine.tokenizer.hf_tokenizer
    lens = [len(ids) for ids in tok(pairs[0] + pairs[1], truncation=True, max_length=st.max_seq_length)["input_ids"]]
    n = len(out)
    assert [o.num_prompt_tokens for o in out] == [lens[i] + lens[n + i] for i in range(n)]


def test_bad_texts_in_either_column_are_error_outputs(bert: tuple[str, torch.nn.Module, LLMEngine],
                                                      pairs: tuple[list[str], list[str]]) -> None:
    engine = bert[2]
    out = engine.score(["", pairs[0][0], pairs[0][1], None], [pairs[1][0], "  ", pairs[1][1], "x"],  # type: ignore
                       request_ids=["a", "b", "c", "d"])
    assert [o.request_id for o in out] == ["a", "b", "c", "d"]
    assert [o.error is None for o in out] == [False, False, True, False]
    assert out[0].error.startswith("text: ") and out[1].error.startswith("text_pair: ")
    assert out[2].score == pytest.approx(engine.score([pairs[0][1]], [pairs[1][1]])[0].score, abs=1e-6)
    with pytest.raises(ValueError, match="one text pair and one id per text"):
        engine.score(["a", "b"], ["c"])


def test_a_causal_lm_refuses_score() -> None:
    engine = LLMEngine.from_config("tiny", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))
    with pytest.raises(ValueError, match="cannot score text pairs"):
        engine.score(["a"], ["b"])
