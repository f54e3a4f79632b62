"""`tokenmill run --task classify` end to end: 24 real GSM8K questions, a tiny random-weight BERT classifier
(BertForSequenceClassification saved with save_pretrained beside the MiniLM tokenizer), a real Dask LocalCluster: the
results' labels and scores are LLMEngine.classify's (a multi-label head's `labels` list too); a model that cannot
classify, and a classifier asked to generate or embed, are refused (exit 2, one line) before any work.

The runs check what a job writes, not its own cluster: they run on the session's LocalCluster (`shared_cluster`,
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
from jobs.summary import JobSummary

runner = CliRunner()
ROWS = 24
LABELS = {0: "clean", 1: "toxic"}


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory: pytest.TempPathFactory, minilm_folder: str) -> str:
    """A 2-layer BERT classifier of random weights (2 labels) with the MiniLM tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, num_labels=2, id2label=LABELS,
                     label2id={v: k for k, v in LABELS.items()})
    folder = tmp_path_factory.mktemp("tiny-bert-classifier")
    BertForSequenceClassification(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(minilm_folder) / name, folder / name)
    return str(folder)


@pytest.fixture()
def questions(tmp_path: Path, data_dir: Path) -> Path:
    """24 real GSM8K rows (id, question) in one Parquet file, one of them empty (an error row)."""
    return write_gsm8k_blanked(data_dir, tmp_path / "in.parquet", 300, ROWS, ["id", "question"], "question", 5)


def test_run_task_classify_end_to_end(questions: Path, tmp_path: Path, classifier_folder: str,
                                      shared_cluster: str) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(questions), str(out), "--task", "classify", "--model", classifier_folder,
                              "--prompt-column", "question", "--rows-per-shard", "16", "--scheduler", shared_cluster,
                              "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["shards"], summary["rows_ok"], summary["rows_error"], summary["output_tokens"]) == (2, 23, 1, 0)
    results = pa.concat_tables([pq.read_table(p) for p in sorted((out / "results").glob("*.parquet"))])
    schema = results.schema
    assert (schema.field("label").type, schema.field("score").type, schema.field("scores").type) == (
        pa.string(), pa.float32(), pa.list_(pa.float32()))
    assert {"prompt_tokens", "truncated", "error"} <= set(schema.names)
    assert results.column("input_row").to_pylist() == list(range(ROWS))

    engine = LLMEngine.from_model(classifier_folder, EngineConfig(device="cpu", dtype="float32"))
    expected = engine.classify(pq.read_table(questions).column("question").to_pylist())
    assert results.column("label").to_pylist() == [o.label for o in expected]
    assert results.column("error").to_pylist()[5] is not None and expected[5].error is not None
    good = [k for k in range(ROWS) if k != 5]
    np.testing.assert_allclose(np.array([results.column("scores").to_pylist()[k] for k in good]),
                               np.stack([expected[k].scores for k in good]), atol=1e-5)
    np.testing.assert_allclose(results.column("score").to_numpy(zero_copy_only=False)[good],
                               [expected[k].score for k in good], atol=1e-5)
    assert results.column("prompt_tokens").to_pylist() == [o.num_prompt_tokens for o in expected]
    assert schema.field("labels").type == pa.list_(pa.string()) and results.column("labels").null_count == ROWS
    # OpenAI's Batch API has no classification endpoint: export refuses in one line (exit 2) and writes nothing
    exported = runner.invoke(app, ["export", str(out), "--to", str(tmp_path / "batch.jsonl")])
    assert exported.exit_code == 2 and "read its results/*.parquet" in exported.output, exported.output
    assert "Traceback" not in exported.output and not (tmp_path / "batch.jsonl").exists()


def test_a_multi_label_classify_job_writes_the_labels_on(questions: Path, tmp_path: Path, minilm_folder: str,
                                                         shared_cluster: str) -> None:
    """problem_type multi_label_classification: `scores` a sigmoid per label, `labels` those >= 0.5 (a list per
    row, possibly empty), `label` the top one, as LLMEngine.classify gives them."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(2)
    names = {0: "algebra", 1: "money", 2: "time"}
    hf = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, num_labels=3, id2label=names, problem_type="multi_label_classification"))
    with torch.no_grad():
        hf.classifier.bias.copy_(torch.tensor([2.0, -2.0, 0.0]))  # one label on, one off, one either way
    folder = tmp_path / "multi-label"
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(minilm_folder) / name, folder / name)
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(questions), str(out), "--task", "classify", "--model", str(folder),
                              "--prompt-column", "question", "--limit", "8", "--scheduler", shared_cluster, "--dtype",
                              "float32"])
    assert res.exit_code == 0, res.output
    results = pa.concat_tables([pq.read_table(p) for p in sorted((out / "results").glob("*.parquet"))])
    engine = LLMEngine.from_model(str(folder), EngineConfig(device="cpu", dtype="float32"))
    expected = engine.classify(pq.read_table(questions).column("question").to_pylist()[:8])
    assert results.column("labels").to_pylist() == [o.labels for o in expected]
    assert results.column("label").to_pylist() == [o.label for o in expected]
    assert expected[5].labels is None and all("algebra" in o.labels and "money" not in o.labels
                                              for k, o in enumerate(expected) if k != 5)
    np.testing.assert_allclose(np.array([results.column("scores").to_pylist()[k] for k in (0, 1)]),
                               np.stack([expected[k].scores for k in (0, 1)]), atol=1e-5)


@pytest.mark.parametrize(("task", "model", "message"), [
    ("classify", "minilm", "cannot classify"), ("generate", "classifier", "cannot generate"),
    ("embed", "classifier", "cannot embed")])
def test_a_task_the_model_cannot_do_is_refused_before_any_work(questions: Path, tmp_path: Path, minilm_folder: str,
                                                               classifier_folder: str, task: str, model: str,
                                                               message: str) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(questions), str(out), "--prompt-column", "question", "--task", task,
                              "--model", minilm_folder if model == "minilm" else classifier_folder])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.splitlines()) == 1, res.stderr
    assert ("--task embed" if model == "minilm" else "--task classify") in res.stderr
    assert not out.exists()


def test_a_classify_run_says_rows_classified() -> None:
    assert this_run(JobSummary(task="classify", run_rows=40, wall_s=2.0)) == (
        "40 rows classified in 2.0 s wall time (20.0 rows/s)")
