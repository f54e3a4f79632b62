"""An embed job's shard (RunConfig task "embed", pipeline.shard_embed) through the shard machinery: the real default
embedding model (all-MiniLM-L6-v2, fp32) on the shared 16 GSM8K rows (one null: an error row), the results' vectors
those of LLMEngine.embed, a stop mid-shard resumed without embedding any row twice, a rerun that writes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shard_helpers import NULL_ROW, ROWS, CountingEngine, interrupt_after

from engine import EngineConfig, LLMEngine
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.layout import results_path
from pipeline.shard import run_shard

DIM = 384


@pytest.fixture(scope="module")
def embedder(minilm_folder: str) -> LLMEngine:
    return LLMEngine.from_model(minilm_folder, EngineConfig(device="cpu", dtype="float32"))


def _cfg(**kw: object) -> RunConfig:
    return RunConfig(prompt_column="question", task="embed", embedding_dim=DIM, checkpoint_seconds=3600.0,
                     **kw)  # type: ignore[arg-type]


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_an_embed_shard_writes_the_engines_vectors(embedder: LLMEngine, shard: Shard, rows_file: str,
                                                   tmp_path: Path) -> None:
    counting = CountingEngine(embedder)
    row = run_shard(counting, shard, "question", str(tmp_path), _cfg(checkpoint_rows=6))
    results = pq.read_table(results_path(str(tmp_path), shard.shard_id))
    assert results.schema.field("embedding").type == pa.list_(pa.float32(), DIM)  # fixed_size_list<float32>[384]
    assert results.column("input_row").to_pylist() == list(range(ROWS))
    questions = pq.read_table(rows_file, columns=["question"]).column("question").to_pylist()
    expected = embedder.embed([q for q in questions if q is not None])
    got = results.to_pylist()
    assert got[NULL_ROW]["embedding"] is None and got[NULL_ROW]["prompt_tokens"] == 0
    assert "null" in got[NULL_ROW]["error"]
    ran = [r for k, r in enumerate(got) if k != NULL_ROW]
    assert all(r["error"] is None and r["truncated"] is False for r in ran)
    vectors = np.array([r["embedding"] for r in ran], dtype=np.float32)
    cos = (vectors * np.stack([o.embedding for o in expected])).sum(1)
    assert cos.min() >= 0.99999  # unit vectors: the model's Normalize module
    assert [r["prompt_tokens"] for r in ran] == [o.num_prompt_tokens for o in expected]
    assert counting.prompts == ROWS - 1  # the null row never reached the engine
    assert (row["rows_ok"], row["rows_error"], row["output_tokens"]) == (ROWS - 1, 1, 0)
    assert row["input_tokens"] == sum(o.num_prompt_tokens for o in expected)
    if row["cost_usd"] > 0:
        assert row["rows_per_dollar"] == pytest.approx(ROWS / row["cost_usd"])
        assert row["input_tokens_per_dollar"] == pytest.approx(row["input_tokens"] / row["cost_usd"])


def test_a_stopped_embed_shard_resumes_without_embedding_a_row_twice(embedder: LLMEngine, shard: Shard,
                                                                     tmp_path: Path) -> None:
    counting = CountingEngine(embedder)
    cfg = _cfg(checkpoint_rows=4)
    stopped = interrupt_after(counting, shard, str(tmp_path), cfg, rows=5)  # the error row + one chunk of 4
    assert stopped.rows_committed == 5 and counting.prompts == 4
    row = run_shard(counting, shard, "question", str(tmp_path), cfg)
    assert counting.prompts == ROWS - 1 and row["rows_resumed"] == 5 and row["attempts"] == 2
    results = pq.read_table(results_path(str(tmp_path), shard.shard_id))
    assert results.column("input_row").to_pylist() == list(range(ROWS))
    assert results.column("embedding").null_count == 1
    before = _files(tmp_path)
    assert run_shard(counting, shard, "question", str(tmp_path), cfg) == row  # committed: nothing runs or is written
    assert counting.prompts == ROWS - 1 and _files(tmp_path) == before
