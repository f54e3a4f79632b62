"""`tokenmill run --task score --text-pair-column COL` end to end: 24 real GSM8K (question, answer) rows, a tiny random-
weight BERT cross-encoder (BertForSequenceClassification of 1 label, saved beside the MiniLM tokenizer), a real Dask
LocalCluster: the results' scores are LLMEngine.score's, an empty answer is an error row naming its column, input
tokens are billed as for embed; `tokenmill report` pages it as a classify job (input tokens and rows per dollar) and
`--dry-run` forecasts it, the pairs tokenized as the job will. Refused (exit 2, one line) before any work: a missing
pair column, the flag with another task, score without it, a model that cannot score (a causal LM, a classifier of
several labels).

The run checks what a job writes, not its own cluster: it runs on the session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from gsm8k_rows import write_gsm8k_blanked
from typer.testing import CliRunner

from engine import EngineConfig, LLMEngine
from jobs.cli import app
from jobs.cli.run_output import this_run
from jobs.control import job_status
from jobs.summary import JobSummary

runner = CliRunner()
ROWS = 24


def _bert_classifier(folder: Path, minilm_folder: str, num_labels: int) -> str:
    """A 2-layer BERT sequence classifier of random weights with the MiniLM tokenizer, saved into `folder`."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, num_labels=num_labels,
                     id2label={i: f"grade {i}" for i in range(num_labels)})  # LABEL_i would not be saved
    BertForSequenceClassification(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(minilm_folder) / name, folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory, minilm_folder: str) -> str:
    return _bert_classifier(tmp_path_factory.mktemp("tiny-cross-encoder"), minilm_folder, 1)


@pytest.fixture()
def qa(tmp_path: Path, data_dir: Path) -> Path:
    """24 real GSM8K rows (id, question, answer) in one Parquet file, one answer empty (an error row)."""
    return write_gsm8k_blanked(data_dir, tmp_path / "in.parquet", 500, ROWS, ["id", "question", "answer"], "answer", 7)


def test_run_task_score_end_to_end(qa: Path, tmp_path: Path, cross_encoder: str, shared_cluster: str) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(qa), str(out), "--task", "score", "--model", cross_encoder,
                              "--prompt-column", "question", "--text-pair-column", "answer", "--rows-per-shard", "16",
                              "--scheduler", shared_cluster, "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["shards"], summary["rows_ok"], summary["rows_error"], summary["output_tokens"]) == (2, 23, 1, 0)
    results = pa.concat_tables([pq.read_table(p) for p in sorted((out / "results").glob("*.parquet"))])
    assert results.schema.field("score").type == pa.float32()
    assert {"prompt_tokens", "truncated", "error", "input_file"} <= set(results.schema.names)
    assert results.column("input_row").to_pylist() == list(range(ROWS))

    table = pq.read_table(qa)
    engine = LLMEngine.from_model(cross_encoder, EngineConfig(device="cpu", dtype="float32"))
    expected = engine.score(table.column("question").to_pylist(), table.column("answer").to_pylist())
    errors = results.column("error").to_pylist()
    assert errors[7] is not None and "'answer'" in errors[7] and expected[7].error is not None
    good = [k for k in range(ROWS) if k != 7]
    np.testing.assert_allclose(results.column("score").to_numpy(zero_copy_only=False)[good],
                               [expected[k].score for k in good], atol=1e-5)
    assert results.column("prompt_tokens").to_pylist() == [o.num_prompt_tokens for o in expected]
    assert results.column("truncated").to_pylist() == [o.truncated for o in expected]
    assert summary["input_tokens"] == sum(o.num_prompt_tokens for o in expected)  # as embed bills them

    report = runner.invoke(app, ["report", str(out), "--html", str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    page, st = (tmp_path / "r.html").read_text(), job_status(str(out))
    assert st.input_tokens == summary["input_tokens"] and st.rows_per_dollar
    per_usd = f"{st.input_tokens_per_dollar:,.0f} / {st.rows_per_dollar:,.0f}"
    assert f"<th>input tokens / rows per dollar</th><td>{per_usd}</td>" in page and "output tokens" not in page
    assert f"<th>input tokens</th><td>{st.input_tokens:,}</td>" in page
    assert "<td>text pair column &#39;answer&#39;: the text is empty</td><td>1</td>" in page, page

    table = runner.invoke(app, ["status", str(out)])  # the per-dollar figures of a job that generates nothing
    assert table.exit_code == 0 and f"│ input tokens / rows per dollar │ {per_usd}" in table.stdout, table.stdout
    assert "│ tokens per dollar" not in table.stdout
    assert json.loads(runner.invoke(app, ["status", str(out), "--json"]).stdout)["task"] == "score"


@pytest.mark.parametrize("model", ["cross-encoder", "embedding model"])
def test_dry_run_of_a_score_job_forecasts_the_pairs_tokens(qa: Path, tmp_path: Path, cross_encoder: str,
                                                           minilm_folder: str, model: str) -> None:
    """The forecast of a score job: its pairs' exact tokens (one shard holds them all) as LLMEngine.score counts
    them (a cross-encoder's pair as one sequence cut at its 128 positions; an embedding model's two texts each), a
    measured rate, no output tokens, input tokens and rows per dollar; nothing written."""
    folder = cross_encoder if model == "cross-encoder" else minilm_folder
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(qa), str(out), "--task", "score", "--model", folder, "--prompt-column",
                              "question", "--text-pair-column", "answer", "--dtype", "float32", "--dry-run",
                              "--json"])
    assert res.exit_code == 0, res.output
    fc = json.loads(res.stdout.strip().splitlines()[-1])
    assert not out.exists()
    table = pq.read_table(qa)
    engine = LLMEngine.from_model(folder, EngineConfig(device="cpu", dtype="float32"))
    expected = engine.score(table.column("question").to_pylist(), table.column("answer").to_pylist())
    assert fc["input_tokens"] == sum(o.num_prompt_tokens for o in expected) > 0
    assert (model == "cross-encoder") == any(o.truncated for o in expected)  # GSM8K answers run past 128 tokens
    assert (fc["task"], fc["rows"], fc["input_rows_sampled"], fc["output_tokens"]) == ("score", ROWS, ROWS, 0)
    assert fc["sample_rows"] == ROWS - 1 and fc["prefill_tokens_per_s"] > 0 and fc["device_s"] > 0
    assert fc["input_tokens_per_dollar"] == fc["input_tokens"] / fc["cost_usd"]
    assert fc["rows_per_dollar"] == ROWS / fc["cost_usd"]


@pytest.mark.parametrize(("case", "message"), [
    ("missing pair column", "text pair column 'reference' not found"),
    ("flag with another task", "--text-pair-column applies to --task score only"),
    ("score without the flag", "--task score needs --text-pair-column"),
    ("causal LM", "cannot score text pairs"),
    ("classifier of 2 labels", "of 2 labels cannot score text pairs")])
def test_a_score_job_that_cannot_run_is_refused_before_any_work(qa: Path, tmp_path: Path, minilm_folder: str,
                                                                cross_encoder: str, gguf_path: str, case: str,
                                                                message: str) -> None:
    out = tmp_path / "out"
    args = {"missing pair column": ["--task", "score", "--model", cross_encoder, "--text-pair-column", "reference"],
            "flag with another task": ["--task", "embed", "--model", minilm_folder, "--text-pair-column", "answer"],
            "score without the flag": ["--task", "score", "--model", cross_encoder],
            "causal LM": ["--task", "score", "--model", gguf_path, "--text-pair-column", "answer"],
            "classifier of 2 labels": ["--task", "score", "--text-pair-column", "answer", "--model",
                                       _bert_classifier(tmp_path / "two-labels", minilm_folder, 2)]}[case]
    res = runner.invoke(app, ["run", str(qa), str(out), "--prompt-column", "question", *args])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
    assert not out.exists() or not (out / "results").exists()


def test_a_score_run_says_rows_scored() -> None:
    assert this_run(JobSummary(task="score", run_rows=40, wall_s=2.0)) == (
        "40 rows scored in 2.0 s wall time (20.0 rows/s)")
