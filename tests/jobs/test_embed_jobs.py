"""`tokenmill run --task embed` end to end: 40 real GSM8K questions, the default embedding model (no --model), a real
Dask LocalCluster; the results' vectors are LLMEngine.embed's, a rerun commits nothing twice; a model that cannot do
the task asked is refused (exit 2, one line) before any work.

The runs check what a job writes, not its own cluster: they run on the session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py), and the reference engine (MiniLM on CPU in fp32) is loaded once for the module."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from engine import EngineConfig, LLMEngine
from jobs.cli import app
from jobs.cli.run_output import this_run
from jobs.control import job_status
from jobs.summary import JobSummary

runner = CliRunner()
ROWS = 40


@pytest.fixture()
def questions(tmp_path: Path, data_dir: Path) -> Path:
    """40 real GSM8K rows (id, question) in one Parquet file."""
    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(200, ROWS)
    path = tmp_path / "in.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def minilm_engine(minilm_folder: str) -> LLMEngine:
    """The reference: the default embedding model on CPU in fp32, as the jobs run it."""
    return LLMEngine.from_model(minilm_folder, EngineConfig(device="cpu", dtype="float32"))


def _committed(out: Path) -> dict[str, bytes]:
    """Every committed object under OUTPUT but the lease (a rerun takes it again), by path."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and "_lease" not in p.parts}


@pytest.mark.slow  # the real models (tests/jobs/conftest.py)
def test_run_task_embed_end_to_end(questions: Path, tmp_path: Path, minilm_engine: LLMEngine, shared_cluster: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_MODEL", raising=False)  # no --model: the default embedding model
    out = tmp_path / "out"
    args = ["run", str(questions), str(out), "--task", "embed", "--prompt-column", "question", "--rows-per-shard",
            "16", "--scheduler", shared_cluster, "--dtype", "float32", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["shards"], summary["rows_ok"], summary["output_tokens"]) == (3, ROWS, 0)
    results = pa.concat_tables([pq.read_table(p) for p in sorted((out / "results").glob("*.parquet"))])
    assert results.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert results.column("input_row").to_pylist() == list(range(ROWS))
    table = pq.read_table(questions)
    assert results.column("id").to_pylist() == table.column("id").to_pylist()

    expected = minilm_engine.embed(table.column("question").to_pylist())
    vectors = np.array(results.column("embedding").to_pylist(), dtype=np.float32)
    cos = (vectors * np.stack([o.embedding for o in expected])).sum(1)  # unit vectors (the Normalize module)
    assert cos.min() >= 0.99999
    assert results.column("prompt_tokens").to_pylist() == [o.num_prompt_tokens for o in expected]
    assert summary["input_tokens"] == sum(o.num_prompt_tokens for o in expected)
    assert summary["rows_per_dollar"] and summary["input_tokens_per_dollar"]

    before = _committed(out)
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout.strip().splitlines()[-1])["already_done"] is True
    assert _committed(out) == before  # nothing committed twice, nothing rewritten
    exported = runner.invoke(app, ["export", str(out)])  # /v1/embeddings lines, one per row
    assert exported.exit_code == 0 and f"exported {ROWS} responses and 0 errors" in exported.stderr, exported.output
    first = json.loads(exported.stdout.splitlines()[0])
    assert first["custom_id"] == table.column("id").to_pylist()[0] and first["response"]["body"]["usage"][
        "prompt_tokens"] == expected[0].num_prompt_tokens
    report = runner.invoke(app, ["report", str(out), "--html", str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    page = (tmp_path / "r.html").read_text()  # input tokens and rows per dollar, not output tokens
    st = job_status(str(out))
    assert st.input_tokens_per_dollar == pytest.approx(summary["input_tokens_per_dollar"], abs=0.1)
    per_usd = f"{st.input_tokens_per_dollar:,.0f} / {st.rows_per_dollar:,.0f}"
    assert f"<th>input tokens / rows per dollar</th><td>{per_usd}</td>" in page and "output tokens" not in page


def test_an_encoder_asked_to_generate_is_refused_before_any_work(questions: Path, tmp_path: Path,
                                                                 minilm_folder: str) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(questions), str(out), "--prompt-column", "question", "--model",
                              minilm_folder])
    assert res.exit_code == 2, res.output
    assert "cannot generate" in res.stderr and "--task embed" in res.stderr and len(res.stderr.splitlines()) == 1
    assert not out.exists()


def test_a_decoder_asked_to_embed_is_refused_before_any_work(questions: Path, tmp_path: Path,
                                                             tiny_model: str) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(questions), str(out), "--prompt-column", "question", "--task", "embed",
                              "--model", tiny_model])
    assert res.exit_code == 2, res.output
    assert "cannot embed" in res.stderr and "--task generate" in res.stderr and len(res.stderr.splitlines()) == 1
    assert not out.exists()


def test_dry_run_of_an_embed_job_forecasts_input_tokens_and_rows_per_dollar(questions: Path, tmp_path: Path,
                                                                           minilm_folder: str,
                                                                           minilm_engine: LLMEngine) -> None:
    """The forecast of an embed job: its rows' exact tokens (one shard holds them all) as the job will count them
    (the --prefix included), a measured encoder rate, no output tokens; nothing written."""
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(questions), str(out), "--prompt-column", "question", "--task", "embed",
                              "--model", minilm_folder, "--prefix", "query: ", "--dtype", "float32", "--dry-run",
                              "--json"])
    assert res.exit_code == 0, res.output
    fc = json.loads(res.stdout.strip().splitlines()[-1])
    assert not out.exists()
    texts = pq.read_table(questions).column("question").to_pylist()
    assert fc["input_tokens"] == sum(o.num_prompt_tokens for o in minilm_engine.embed(texts, prefix="query: "))
    assert (fc["task"], fc["rows"], fc["input_rows_sampled"], fc["output_tokens"]) == ("embed", ROWS, ROWS, 0)
    assert fc["prefill_tokens_per_s"] > 0 and fc["device_s"] > 0 and fc["sample_rows"] == ROWS
    assert fc["input_tokens_per_dollar"] == fc["input_tokens"] / fc["cost_usd"]
    assert fc["rows_per_dollar"] == ROWS / fc["cost_usd"]


@pytest.mark.slow  # the real model on a real LocalCluster (tests/jobs/conftest.py)
def test_float16_embeddings_on_request_and_a_resume_keeps_the_dtype(questions: Path, tmp_path: Path,
                                                                    minilm_folder: str, minilm_engine: LLMEngine,
                                                                    shared_cluster: str) -> None:
    """--embedding-dtype float16: a fixed_size_list<float16>[384] column, each vector the engine's float32 one
    rounded; the same OUTPUT resumed with float32 is refused (exit 2) before any work, as any changed option."""
    out = tmp_path / "out"
    args = ["run", str(questions), str(out), "--task", "embed", "--model", minilm_folder, "--prompt-column",
            "question", "--limit", "8", "--dtype", "float32", "--scheduler", shared_cluster]
    res = runner.invoke(app, [*args, "--embedding-dtype", "float16"])
    assert res.exit_code == 0, res.output
    results = pa.concat_tables([pq.read_table(p) for p in sorted((out / "results").glob("*.parquet"))])
    assert results.schema.field("embedding").type == pa.list_(pa.float16(), 384)
    expected = np.stack([o.embedding for o in minilm_engine.embed(pq.read_table(questions).column(
        "question").to_pylist()[:8])])
    np.testing.assert_allclose(np.array(results.column("embedding").to_pylist()), expected.astype(np.float16),
                               atol=1e-3)
    before = _committed(out)
    changed = runner.invoke(app, [*args, "--embedding-dtype", "float32"])
    assert changed.exit_code == 2, changed.output
    assert "embedding_dtype: the job has 'float16', this run asks for 'float32'" in changed.stderr
    assert _committed(out) == before


def test_quantizing_an_embed_model_is_refused_before_any_work(questions: Path, tmp_path: Path,
                                                              minilm_folder: str) -> None:
    res = runner.invoke(app, ["run", str(questions), str(tmp_path / "out"), "--prompt-column", "question", "--task",
                              "embed", "--model", minilm_folder, "--quantization", "int8"])
    assert res.exit_code == 2 and "a bert model (an encoder) runs with --quantization none or auto" in res.stderr
    assert not (tmp_path / "out").exists()


def test_an_embed_run_says_rows_embedded_not_output_tokens() -> None:
    """The summary table's "this run" line of an embed job counts rows embedded and rows/s (it generates no output
    tokens: "0 output tokens generated" would say nothing); a generate job's line is unchanged."""
    embed = JobSummary(task="embed", run_rows=40, wall_s=2.0, input_tokens=1_000)
    assert this_run(embed) == "40 rows embedded in 2.0 s wall time (20.0 rows/s)"
    generate = JobSummary(run_rows=40, run_output_tokens=320, wall_s=2.0)
    assert this_run(generate) == "40 rows, 320 output tokens generated in 2.0 s wall time (160.0 output tokens/s)"


@pytest.mark.slow  # the real model on a real LocalCluster (tests/jobs/conftest.py)
def test_embed_options_shape_the_results(questions: Path, tmp_path: Path, minilm_folder: str,
                                         minilm_engine: LLMEngine, shared_cluster: str) -> None:
    """--dimensions 128 --prefix "query: ": a 128-wide float32 column of unit vectors, each LLMEngine.embed's with
    the same options (the prefix's tokens counted in prompt_tokens)."""
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(questions), str(out), "--task", "embed", "--model", minilm_folder,
                              "--prompt-column", "question", "--limit", "16", "--dtype", "float32", "--dimensions",
                              "128", "--prefix", "query: ", "--scheduler", shared_cluster, "--json"])
    assert res.exit_code == 0, res.output
    results = pa.concat_tables([pq.read_table(p) for p in sorted((out / "results").glob("*.parquet"))])
    assert results.schema.field("embedding").type == pa.list_(pa.float32(), 128) and results.num_rows == 16
    vectors = np.array(results.column("embedding").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    texts = pq.read_table(questions).column("question").to_pylist()[:16]
    expected = minilm_engine.embed(texts, dimensions=128, prefix="query: ")
    assert (vectors * np.stack([o.embedding for o in expected])).sum(1).min() >= 0.99999
    assert results.column("prompt_tokens").to_pylist() == [o.num_prompt_tokens for o in expected]
    assert [o.num_prompt_tokens for o in expected] != [o.num_prompt_tokens for o in minilm_engine.embed(texts)]


@pytest.mark.parametrize(("options", "message"), [
    (["--task", "embed", "--dimensions", "385"], "--dimensions 385 is more than the 384 elements"),
    # a value out of the spec's range: its validation's header and one problem line, as --top-p 0 gets
    (["--task", "embed", "--dimensions", "0"], "(--dimensions): Input should be greater than or equal to 1, got 0"),
    (["--prefix", "query: ", "--no-truncate"], "--prefix, --no-truncate apply to --task embed only"),
    (["--normalize"], "--normalize apply to --task embed only"),
    (["--embedding-dtype", "float16"], "--embedding-dtype apply to --task embed only"),
])
def test_bad_embed_options_are_refused_in_one_line_before_any_work(questions: Path, tmp_path: Path,
                                                                   minilm_folder: str, tiny_model: str,
                                                                   options: list[str], message: str) -> None:
    model = minilm_folder if "embed" in options else tiny_model
    res = runner.invoke(app, ["run", str(questions), str(tmp_path / "out"), "--prompt-column", "question",
                              "--model", model, *options])
    assert res.exit_code == 2, res.output
    assert message in res.stderr and len(res.stderr.splitlines()) == 1 + ("0" in options), res.stderr
    assert not (tmp_path / "out").exists()
