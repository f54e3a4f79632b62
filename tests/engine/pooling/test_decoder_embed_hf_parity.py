"""A causal decoder as an embedding model (Qwen3-Embedding's shape: tests/engine/st_folders.py) against
sentence-transformers' own encode of the same folder, on real texts (some over max_seq_length: truncated alike):
cosine >= 0.99999 in fp32; the packed causal forward (engine.model.packed_forward) against one private-cache
forward per row; what such a folder does (embed only: it holds no LM head), and a generation model without
sentence-transformers files refusing to embed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from st_folders import MAX_SEQ_LENGTH, save_qwen3_embedder

from engine import EngineConfig, LLMEngine
from engine.model.packed_forward import forward_packed
from engine.model.registry import config_tasks
from engine.model.sequence_forward import forward_sequence
from engine.pooling.embedder import Embedder, plan_batches
from engine.pooling.st_config import PoolingConfig

CPU_FP32 = EngineConfig(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory, minilm_folder: str) -> Path:
    return save_qwen3_embedder(tmp_path_factory.mktemp("qwen3-embedding") / "model", minilm_folder)


@pytest.fixture(scope="module")
def qwen3(qwen3_folder: Path) -> LLMEngine:
    return LLMEngine.from_model(str(qwen3_folder), CPU_FP32)


@pytest.fixture(scope="module")
def texts(embed_texts: list[str]) -> list[str]:
    """128 real texts of 10 to over MAX_SEQ_LENGTH tokens: GSM8K questions and AlpacaEval instructions."""
    return embed_texts[:128]


def test_embeddings_equal_sentence_transformers(qwen3: LLMEngine, qwen3_folder: Path, texts: list[str]) -> None:
    from sentence_transformers import SentenceTransformer

    theirs = SentenceTransformer(str(qwen3_folder), device="cpu").encode(texts, batch_size=16, convert_to_numpy=True)
    out = qwen3.embed(texts)
    ours = np.stack([o.embedding for o in out])
    assert ours.shape == theirs.shape == (len(texts), 64) and ours.dtype == np.float32
    cosine = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs, axis=-1)
    assert cosine.min() >= 0.99999
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert np.allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)  # its Normalize module
    lengths = [o.num_prompt_tokens for o in out]
    assert max(lengths) == MAX_SEQ_LENGTH and min(lengths) < MAX_SEQ_LENGTH // 3  # some cut, some short
    assert [o.truncated for o in out] == [n == MAX_SEQ_LENGTH for n in lengths]
    assert len(plan_batches(lengths, CPU_FP32.max_num_batched_tokens, CPU_FP32.max_num_seqs)) > 1


def test_the_tokenizer_appends_its_end_token(qwen3: LLMEngine, texts: list[str]) -> None:
    """Its last token, the one pooled, is the end token the tokenizer's template appends, cut rows included."""
    sep = qwen3.tokenizer.hf_tokenizer.convert_tokens_to_ids("[SEP]")
    rows = qwen3.tokenizer.encode_truncated(texts, MAX_SEQ_LENGTH)
    assert all(row[-1] == sep and row[0] != qwen3.tokenizer.hf_tokenizer.cls_token_id for row, _ in rows)


def test_packed_rows_equal_one_private_cache_forward_each(qwen3: LLMEngine, texts: list[str]) -> None:
    rows = [ids for ids, _ in qwen3.tokenizer.encode_truncated(texts[:12], MAX_SEQ_LENGTH)]
    assert len({len(r) for r in rows}) > 6  # mixed lengths in one batch
    model = qwen3.model
    with torch.inference_mode():
        packed = forward_packed(model, rows, torch.device("cpu"))
        alone = torch.cat([forward_sequence(model, torch.tensor(r)) for r in rows])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_small_batches_equal_one_batch(qwen3: LLMEngine, texts: list[str]) -> None:
    small = qwen3.with_config(dataclasses.replace(CPU_FP32, max_num_batched_tokens=200, max_num_seqs=3))
    ours = np.stack([o.embedding for o in small.embed(texts[:24])])
    whole = np.stack([o.embedding for o in qwen3.embed(texts[:24])])
    np.testing.assert_allclose(ours, whole, atol=1e-5, rtol=0)


def test_the_folder_embeds_and_cannot_generate(qwen3: LLMEngine, qwen3_folder: Path) -> None:
    """sentence-transformers saved the trunk (Qwen3Model: no lm_head.weight, untied): it embeds only; with an LM
    head (tied, or its own) the same folder would generate too."""
    from jobs.errors import JobError
    from jobs.plan.task_check import check_task, embedding_dim

    cfg = qwen3.model_config
    assert (cfg.pooling_files, cfg.lm_head, qwen3.tasks) == (True, False, ("embed", "score"))
    assert not hasattr(qwen3.model, "lm_head") and qwen3.num_kv_blocks == 0
    with pytest.raises(ValueError, match="cannot generate: it does embed"):
        qwen3.generate(["a text"])
    with pytest.raises(ValueError, match="cannot classify"):
        qwen3.classify(["a text"])
    assert config_tasks(dataclasses.replace(cfg, lm_head=True)) == ("generate", "embed", "score")
    assert config_tasks(dataclasses.replace(cfg, pooling_files=False, lm_head=True)) == ("generate",)
    check_task(str(qwen3_folder), "embed")
    assert embedding_dim(str(qwen3_folder)) == 64
    with pytest.raises(JobError, match="cannot generate"):
        check_task(str(qwen3_folder), "generate")


def test_a_generation_model_without_pooling_files_refuses_embed(tmp_path: Path) -> None:
    """No modules.json: tokenmill does not guess a pooling for a causal LM (README, Embeddings)."""
    engine = LLMEngine.from_config("tiny", dataclasses.replace(CPU_FP32, num_kv_blocks=8))
    assert engine.tasks == ("generate",) and engine.pooling_runner is None
    with pytest.raises(ValueError, match=r"cannot embed: a causal LM embeds only when its folder holds "
                                         r"sentence-transformers files \(modules.json"):
        engine.embed(["a text"])


def test_a_copy_without_its_modules_json_is_refused(qwen3: LLMEngine) -> None:
    """A model whose config says its folder has pooling files but whose pooling was not read from them (a copy that
    lost modules.json) would pool by mean: refused by name."""
    with pytest.raises(ValueError, match="not read from a modules.json"):
        Embedder(qwen3.model, qwen3.tokenizer, PoolingConfig(), torch.device("cpu"), 2048, 8)
