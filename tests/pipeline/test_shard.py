"""One shard through the real engine: bad rows become error rows, results and accounting are committed once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine import LLMEngine
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.layout import accounting_path, results_path
from pipeline.shard import ShardError, run_shard
from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA


@pytest.fixture()
def bad_rows_file(tmp_path: Path, gsm8k_questions: list[str]) -> tuple[str, list[str]]:
    """Real GSM8K prompts with a null, an empty and an over-long prompt mixed in."""
    prompts = [gsm8k_questions[0], None, gsm8k_questions[1], "", " ".join(gsm8k_questions[:400]),
               gsm8k_questions[2]]
    ids = [f"row-{i}" for i in range(len(prompts))]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(prompts, pa.string())}), path)
    return str(path), ids


def test_bad_rows_become_error_rows_and_the_shard_goes_on(engine: LLMEngine, bad_rows_file: tuple[str, list[str]],
                                                          tmp_path: Path) -> None:
    path, ids = bad_rows_file
    shard = Shard("00000-000000000", path, f"file://{path}", 0, len(ids))
    out = str(tmp_path / "out")
    cfg = RunConfig(max_tokens=6, price_per_hour_usd=3.6)
    acct = run_shard(engine, shard, "prompt", out, cfg)

    results = pq.read_table(results_path(out, shard.shard_id))
    assert results.schema.equals(RESULTS_SCHEMA, check_metadata=False)
    rows = results.to_pylist()
    assert [r["id"] for r in rows] == ids
    assert [r["finish_reason"] for r in rows] == ["length", "error", "length", "error", "error", "length"]
    assert "null" in rows[1]["error"] and "empty" in rows[3]["error"] and "shorten" in rows[4]["error"]
    # The over-long prompt's row says how long it was (its error's count), the others that did not run 0.
    assert rows[4]["error"].startswith(f"the prompt has {rows[4]['prompt_tokens']} tokens;")
    assert rows[4]["prompt_tokens"] > engine.max_model_len and rows[1]["prompt_tokens"] == rows[3]["prompt_tokens"] == 0
    assert all(r["error"] is None and r["completion_tokens"] == 6 and r["completion"]
               for r in (rows[0], rows[2], rows[5]))
    assert rows[0]["model"] == engine.model_name

    acc = pq.read_table(accounting_path(out, shard.shard_id, 1))
    assert acc.schema.equals(ACCOUNTING_SCHEMA, check_metadata=False)
    (a,) = acc.to_pylist()
    assert (a["rows"], a["rows_ok"], a["rows_error"]) == (6, 3, 3)
    assert a["output_tokens"] == 18  # input tokens: of the rows that ran (an over-long prompt was never computed)
    assert a["input_tokens"] == sum(r["prompt_tokens"] for r in rows if r["error"] is None) > 0
    assert a["device_s_billed"] == a["device_s"] >= a["wall_s"] > 0  # one attempt: it alone is billed
    assert a["cost_usd"] == pytest.approx(a["device_s_billed"] / 3600 * 3.6)
    assert a["tokens_per_dollar"] == pytest.approx(18 / a["cost_usd"])
    assert (a["attempts"], a["preemptions"], a["rows_resumed"], a["kv_preemptions"]) == (1, 0, 0, 0)
    assert (a["device"], a["dtype"], a["quantization"]) == ("cpu", "float32", "none")  # the session engine's
    assert acct["rows_ok"] == 3


def test_rerun_of_a_committed_shard_changes_nothing(engine: LLMEngine, bad_rows_file: tuple[str, list[str]],
                                                    tmp_path: Path) -> None:
    path, ids = bad_rows_file
    shard = Shard("00000-000000000", path, f"file://{path}", 0, 3)
    out = str(tmp_path / "out")
    first = run_shard(engine, shard, "prompt", out, RunConfig(max_tokens=4))
    before = os.stat(results_path(out, shard.shard_id)).st_mtime_ns
    again = run_shard(engine, shard, "prompt", out, RunConfig(max_tokens=4))
    assert os.stat(results_path(out, shard.shard_id)).st_mtime_ns == before
    assert again["wall_s"] == first["wall_s"] and again["rows"] == 3


def test_unreadable_file_fails_the_shard_with_the_file_named(engine: LLMEngine, tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(b"PAR1 not really")
    shard = Shard("00000-000000000", str(bad), f"file://{bad}", 0, -1)
    with pytest.raises(ShardError, match="corrupt.parquet"):
        run_shard(engine, shard, "prompt", str(tmp_path / "out"), RunConfig())
    assert not (tmp_path / "out" / "results").exists()
    end = json.loads((tmp_path / "out" / "attempts" / shard.shard_id / "attempt-001.end.json").read_text())
    assert end["outcome"] == "failed" and "corrupt.parquet" in end["error"] and end["rows_committed"] == 0


def test_a_row_whose_max_tokens_was_cut_to_fit_max_model_len_says_so(engine: LLMEngine, shard: Shard,
                                                                     tmp_path: Path) -> None:
    """max_tokens 48 under max_model_len 128: rows whose prompt + 48 tokens overflow stop at 128 tokens in all with
    finish_reason length and a note naming both numbers; rows that fit run their 48 tokens and have no note."""
    from engine import EngineConfig

    short = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_model_len=128))
    out = str(tmp_path / "out")
    run_shard(short, shard, "question", out, RunConfig(max_tokens=48))
    rows = [r for r in pq.read_table(results_path(out, shard.shard_id)).to_pylist() if r["error"] is None]
    cut = [r for r in rows if r["prompt_tokens"] + 48 > 128]
    fit = [r for r in rows if r["prompt_tokens"] + 48 <= 128]
    assert cut and fit, [r["prompt_tokens"] for r in rows]  # GSM8K prompts on both sides of 80 tokens
    for r in cut:
        assert r["finish_reason"] == "length" and r["prompt_tokens"] + r["completion_tokens"] == 128
        assert r["note"] == (f"max_tokens 48 was cut to {128 - r['prompt_tokens']}: the prompt's "
                             f"{r['prompt_tokens']} tokens and the output fill max_model_len 128 (--max-model-len, "
                             "at most the model's context)")
    assert all(r["completion_tokens"] == 48 and r["note"] is None for r in fit)  # EOS is never greedy here
