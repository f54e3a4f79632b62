"""`tokenmill run` end to end: real GSM8K rows, a real Dask LocalCluster with worker processes, the real model."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from jobs.cli import app
from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA

runner = CliRunner()


@pytest.fixture()
def gsm8k_folder(tmp_path: Path, data_dir: Path) -> Path:
    """Two Parquet files of real GSM8K rows (14 + 6), the first with the prompt in a `question` column."""
    t = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(100, 20)
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(t.slice(0, 14), folder / "a.parquet")
    pq.write_table(t.slice(14, 6), folder / "b.parquet")
    return folder


def _summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_run_end_to_end_every_id_exactly_once(gsm8k_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["run", str(gsm8k_folder), str(out), "--prompt-column", "question", "--rows-per-shard", "8",
            "--max-tokens", "8", "--workers", "2", "--price-per-hour", "1.5", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = _summary(res.stdout)
    assert summary["shards"] == 3 and summary["shards_failed"] == 0
    assert summary["rows_ok"] == 20 and summary["output_tokens"] == 160
    # Not a terminal: progress comes as JSON lines on stderr, ending at the job's totals.
    progress = [json.loads(line) for line in res.stderr.splitlines() if line.startswith('{"event": "progress"')]
    assert progress and (progress[-1]["rows_done"], progress[-1]["output_tokens"]) == (20, 160)

    results = pq.read_table(out / "results")
    assert results.schema.equals(RESULTS_SCHEMA, check_metadata=False)
    expected = pq.read_table(gsm8k_folder).column("id").to_pylist()
    assert sorted(results.column("id").to_pylist()) == sorted(expected)  # every id exactly once
    assert all(results.column("completion_tokens").to_pylist()) and None not in results.column("completion")

    acc = pq.read_table(out / "accounting")
    assert acc.schema.equals(ACCOUNTING_SCHEMA, check_metadata=False)
    assert acc.num_rows == 3 and sum(acc.column("rows").to_pylist()) == 20
    assert all(r["price_per_hour_usd"] == 1.5 and r["tokens_per_dollar"] > 0 and r["device"] == "cpu"
               for r in acc.to_pylist())

    manifest = json.loads((out / "_SUCCESS").read_text())
    assert [s["shard_id"] for s in manifest["shards"]] == sorted(acc.column("shard_id").to_pylist())
    assert manifest["summary"]["rows_ok"] == 20
    assert all((out / s["results"]).is_file() for s in manifest["shards"])

    # A rerun into the same OUTPUT finds every shard committed and rewrites nothing.
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.parquet")}
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.parquet")} == mtimes


def test_missing_prompt_column_stops_before_any_work(gsm8k_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(gsm8k_folder), str(out), "--workers", "1"])
    assert res.exit_code == 2
    assert "'prompt' not found" in res.output and "['id', 'question']" in res.output
    assert not out.exists()


def test_corrupt_file_fails_its_shard_only(gsm8k_folder: Path, tmp_path: Path) -> None:
    (gsm8k_folder / "b.parquet").write_bytes(b"PAR1 truncated upload")
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(gsm8k_folder), str(out), "--prompt-column", "question", "--max-tokens", "4",
                              "--workers", "1", "--json"])
    assert res.exit_code == 1
    summary = _summary(res.stdout)
    assert summary["shards_ok"] == 1 and list(summary["failed"]) == ["00001-000000000"]
    assert "b.parquet" in summary["failed"]["00001-000000000"]
    assert pq.read_table(out / "results").num_rows == 14
    assert not (out / "_SUCCESS").exists()  # the job is not done until every shard is


def test_bad_option_is_a_usage_error(gsm8k_folder: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["run", str(gsm8k_folder), str(tmp_path / "o"), "--top-p", "1.5"])
    assert res.exit_code == 2 and "top_p" in res.output


def test_messages_column_input(tmp_path: Path, data_dir: Path) -> None:
    qs = pq.read_table(data_dir / "alpaca_eval.parquet", columns=["instruction"]).column("instruction")
    msgs = [[{"role": "user", "content": q}] for q in qs.to_pylist()[:4]]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    res = runner.invoke(app, ["run", str(tmp_path / "chat.parquet"), str(tmp_path / "o"), "--max-tokens", "4",
                              "--json"])
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "o" / "results").column("id").to_pylist() == ["0", "1", "2", "3"]
