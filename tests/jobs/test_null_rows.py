"""A job whose rows are all null (issue 45) finishes with exit 0 without its workers ever loading the engine: error
rows and accounting committed, 0 device-seconds, and the summary and the dry run say so. A job with rows to run
loads it once per worker, and a model changed between runs is still refused. Engine loads are counted by the files
CountedEnginePlugin leaves (tests/jobs/counted_engine.py), never by timing. The jobs run on the session's LocalCluster
(`shared_cluster`, tests/jobs/conftest.py): each test's counted plugin is registered afresh on its worker, which
loads its engine only when a shard has a row to run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from counted_engine import CountedEnginePlugin, loads
from test_model_pin import ENGINE, _files, _rewrite_tail
from typer.testing import CliRunner

import jobs.cluster
import jobs.plan.forecast
from engine import LLMEngine
from jobs.cli import app
from jobs.errors import JobError
from jobs.runner import run_job
from pipeline.config import RunConfig
from pipeline.manifest import pin_manifest
from pipeline.model_pin import fingerprint_model, pin_model
from pipeline.shard import run_shard
from pipeline.shard_engine import EngineFacts, LazyEngine

runner = CliRunner()
ARGS = ["--prompt-column", "question", "--max-tokens", "3", "--rows-per-shard", "3", "--device", "cpu",
        "--dtype", "float32", "--workers", "1"]


def _input(tmp_path: Path, questions: list[str | None]) -> Path:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(len(questions))],
                             "question": pa.array(questions, pa.string())}), path)
    return path


@pytest.fixture()
def loads_dir(tmp_path: Path, tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where this test's workers record their engine loads (the tiny model for a job without one)."""
    folder = tmp_path / "loads"
    folder.mkdir()

    def counted(model: str | None, *args: Any, **kwargs: Any) -> CountedEnginePlugin:
        return CountedEnginePlugin(str(folder), model if model is not None else tiny_model, *args, **kwargs)

    monkeypatch.setattr(jobs.cluster, "EnginePlugin", counted)
    return folder


def _summary(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_job_whose_rows_are_all_null_finishes_without_loading_the_engine(
        loads_dir: Path, engine: LLMEngine, tmp_path: Path, shared_cluster: str) -> None:
    src, out = _input(tmp_path, [None] * 6), tmp_path / "out"
    res = runner.invoke(app, ["run", str(src), str(out), *ARGS, "--scheduler", shared_cluster, "--json"])
    assert res.exit_code == 0, res.output
    assert loads(loads_dir) == 0
    s = _summary(res.stdout)
    assert (s["shards_ok"], s["rows_ok"], s["rows_error"], s["output_tokens"]) == (2, 0, 6, 0)
    assert s["device_s"] == s["cost_usd"] == 0.0 and s["tokens_per_dollar"] is None
    assert "no row ran: all 6 committed rows are error rows" in res.stderr
    assert (out / "_SUCCESS").is_file()

    pin = json.loads((out / "_manifest" / "model.json").read_text())
    rows = pq.read_table(out / "results").to_pylist()
    assert len(rows) == 6 and {r["finish_reason"] for r in rows} == {"error"}
    assert {r["error"] for r in rows} == {"the prompt is null; fill in the prompt column for this row"}
    assert {r["model"] for r in rows} == {engine.model_name}
    assert {r["model_fingerprint"] for r in rows} == {pin["fingerprint"]}
    accounting = pq.read_table(out / "accounting").to_pylist()
    assert len(accounting) == 2
    for a in accounting:
        assert a["device_s"] == a["device_s_billed"] == a["cost_usd"] == 0.0 and a["rows_error"] == 3
        assert (a["device"], a["dtype"], a["quantization"], a["model"], a["model_fingerprint"]) == (
            "cpu", "float32", "none", engine.model_name, pin["fingerprint"])


def test_a_job_with_null_and_real_rows_loads_the_engine_once(loads_dir: Path, engine: LLMEngine, tmp_path: Path,
                                                             gsm8k_questions: list[str], shared_cluster: str) -> None:
    src, out = _input(tmp_path, [None, None, None, *gsm8k_questions[60:63]]), tmp_path / "out"
    res = runner.invoke(app, ["run", str(src), str(out), *ARGS, "--scheduler", shared_cluster, "--json"])
    assert res.exit_code == 0, res.output
    assert loads(loads_dir) == 1
    s = _summary(res.stdout)
    assert (s["shards_ok"], s["rows_ok"], s["rows_error"], s["output_tokens"]) == (2, 3, 3, 9)
    assert "no row ran" not in res.stderr
    by_start = {a["row_start"]: a for a in pq.read_table(out / "accounting").to_pylist()}
    assert by_start[0]["device_s"] == 0.0 and by_start[3]["device_s"] > 0
    assert by_start[0]["model"] == by_start[3]["model"] == engine.model_name
    assert by_start[0]["model_fingerprint"] == by_start[3]["model_fingerprint"] is not None
    assert s["device_s"] == pytest.approx(by_start[3]["device_s_billed"], abs=1e-3)  # the summary rounds to ms


def test_a_job_of_null_rows_resumed_with_another_model_is_refused(tiny_model: str, tmp_path: Path,
                                                                  gsm8k_questions: list[str],
                                                                  shared_cluster: str) -> None:
    """The first shard, all null, finishes without an engine; the model's bytes change; the resume is refused
    before any work (exit 2, the file named). With the model restored the job finishes, every row under the one
    pinned fingerprint."""
    src = _input(tmp_path, [None, None, None, *gsm8k_questions[70:73]])
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model, model)
    out, cfg = str(tmp_path / "out"), RunConfig(prompt_column="question", max_tokens=3, rows_per_shard=3)
    manifest, _ = pin_manifest(out, str(src), cfg)
    pin, _ = pin_model(out, fingerprint_model(str(model)))
    first, _second = manifest.shards()

    def no_load() -> Any:
        raise AssertionError("a shard with no row to run loaded the engine")

    run_shard(LazyEngine(no_load, lambda: EngineFacts.planned(str(model), ENGINE, pin.fingerprint)), first,
              "question", out, cfg)
    before = _files(Path(out))
    _rewrite_tail(model / "model.safetensors")
    with pytest.raises(JobError) as refused:
        run_job(str(src), out, cfg, model=str(model), engine_config=ENGINE)
    assert refused.value.exit_code == 2 and "model.safetensors was" in str(refused.value)
    assert _files(Path(out)) == before

    shutil.rmtree(model)
    shutil.copytree(tiny_model, model)
    summary = run_job(str(src), out, cfg, model=str(model), engine_config=ENGINE, scheduler_address=shared_cluster)
    assert summary.shards_ok == 2 and (summary.rows_ok, summary.rows_error) == (3, 3)
    rows = pq.read_table(Path(out) / "results").to_pylist()
    assert {r["model_fingerprint"] for r in rows} == {pin.fingerprint} and len({r["model"] for r in rows}) == 1


class _NoEngine:
    @staticmethod
    def from_model(*args: Any, **kwargs: Any) -> LLMEngine:
        raise AssertionError("the dry run of a job with no row to run loaded the engine")


def test_the_dry_run_of_an_all_null_job_forecasts_nothing_billed_without_an_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: exit 2, "no row of the first shard can run ... nothing to forecast", for a job that runs (exit 0)."""
    monkeypatch.setattr(jobs.plan.forecast, "LLMEngine", _NoEngine)
    src, out = _input(tmp_path, [None] * 6), tmp_path / "out"
    res = runner.invoke(app, ["run", str(src), str(out), *ARGS, "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    fc = _summary(res.stdout)
    assert (fc["rows"], fc["shards"], fc["input_tokens"], fc["output_tokens"], fc["sample_rows"]) == (6, 2, 0, 0, 0)
    assert fc["device_s"] == fc["cost_usd"] == 0.0 and (fc["device"], fc["dtype"]) == ("cpu", "float32")
    assert "no row can run: all 6 rows will be error rows" in fc["note"]
    assert not out.exists()


def test_the_dry_run_calibrates_on_the_first_shard_with_rows_to_run(tmp_path: Path,
                                                                    gsm8k_questions: list[str]) -> None:
    """A first shard of null rows is skipped, not a reason to refuse: the second shard's rows calibrate, and half
    the job's rows run (the tiny model never stops early: 3 tokens each)."""
    src, out = _input(tmp_path, [None, None, None, *gsm8k_questions[80:83]]), tmp_path / "out"
    res = runner.invoke(app, ["run", str(src), str(out), *ARGS, "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    fc = _summary(res.stdout)
    assert (fc["rows"], fc["sample_rows"], fc["output_tokens"], fc["output_tokens_max"]) == (6, 3, 9, 9)
    assert fc["device_s"] > 0 and fc["note"] == ""
