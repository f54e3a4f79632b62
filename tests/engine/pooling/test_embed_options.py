"""LLMEngine.embed's options (engine.pooling.embed_options) on all-MiniLM-L6-v2 and real texts: Matryoshka
dimensions and normalize are numpy's cut-then-normalize of the whole vector, a prefix is embedding the prefixed text,
truncate=False makes error rows of the over-long texts only; bad options raise ValueError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine

FP32 = EngineConfig(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory, minilm_folder: str) -> LLMEngine:
    """all-MiniLM-L6-v2 without its modules.json: mean pooling, not normalized (sentence-transformers' rule for a
    plain Hugging Face folder), so normalizing is visible."""
    folder = tmp_path_factory.mktemp("minilm-raw")
    for f in Path(minilm_folder).iterdir():
        if f.is_file() and f.name != "modules.json":
            (folder / f.name).symlink_to(f)
    return LLMEngine.from_model(str(folder), FP32)


@pytest.fixture(scope="module")
def engine(minilm_folder: str) -> LLMEngine:
    return LLMEngine.from_model(minilm_folder, FP32)


@pytest.fixture(scope="module")
def texts(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    """8 GSM8K questions and the 3 longest AlpacaEval instructions (over 256 tokens: all-MiniLM-L6-v2 cuts them)."""
    longest = sorted(alpaca_instructions, key=len)[-3:]
    return [*gsm8k_questions[:4], longest[0], *gsm8k_questions[4:8], *longest[1:]]


def _vectors(outputs: list) -> np.ndarray:
    return np.stack([o.embedding for o in outputs])


def test_dimensions_and_normalize_are_cut_then_l2(raw: LLMEngine, texts: list[str]) -> None:
    full = _vectors(raw.embed(texts))
    norms = np.linalg.norm(full, axis=1)
    assert full.shape == (len(texts), 384) and np.abs(norms - 1).min() > 0.01  # the model's vectors: not unit
    cut = _vectors(raw.embed(texts, dimensions=128))
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    assert cut.shape == (len(texts), 128) and cut.dtype == np.float32
    np.testing.assert_allclose(cut, expected, atol=1e-6, rtol=0)
    np.testing.assert_allclose(_vectors(raw.embed(texts, normalize=True)), full / norms[:, None], atol=1e-6, rtol=0)
    np.testing.assert_allclose(_vectors(raw.embed(texts, dimensions=384)), full / norms[:, None], atol=1e-6, rtol=0)


def test_a_prefix_is_embedding_the_prefixed_text(engine: LLMEngine, texts: list[str]) -> None:
    plain = engine.embed(texts[:4])
    ours = engine.embed(texts[:4], prefix="query: ")
    theirs = engine.embed([f"query: {t}" for t in texts[:4]])
    np.testing.assert_allclose(_vectors(ours), _vectors(theirs), atol=1e-6, rtol=0)
    assert [o.num_prompt_tokens for o in ours] == [o.num_prompt_tokens for o in theirs]
    assert all(o.num_prompt_tokens > p.num_prompt_tokens for o, p in zip(ours, plain, strict=True))
    assert (_vectors(ours) * _vectors(plain)).sum(1).max() < 0.999  # the prefix changes every vector


def test_no_truncate_makes_error_rows_of_the_long_texts_only(engine: LLMEngine, texts: list[str]) -> None:
    cut = engine.embed(texts)
    strict = engine.embed(texts, truncate=False)
    whole = [len(ids) for ids in engine.tokenizer.hf_tokenizer(texts)["input_ids"]]
    assert [o.truncated for o in cut] == [n > 256 for n in whole] and sum(o.truncated for o in cut) == 3
    for c, s, n in zip(cut, strict, whole, strict=True):
        if c.truncated:
            assert s.embedding is None and s.num_prompt_tokens == 0
            assert f"is {n} tokens" in s.error and "limit of 256" in s.error
        else:
            assert s.error is None and not s.truncated and s.num_prompt_tokens == c.num_prompt_tokens
            np.testing.assert_allclose(s.embedding, c.embedding, atol=1e-6, rtol=0)  # other batches


@pytest.mark.parametrize(("options", "message"), [
    ({"dimensions": 0}, "dimensions must be None or an int >= 1"),
    ({"dimensions": True}, "dimensions must be None or an int >= 1"),
    ({"dimensions": 385}, "dimensions 385 is more than the model's 384"),
    ({"prefix": None}, "prefix must be a string"),
    ({"truncate": "no"}, "truncate must be True or False"),
])
def test_bad_options_raise(engine: LLMEngine, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.embed(["What is 2 + 2?"], **options)
