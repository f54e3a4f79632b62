"""`tokenmill run` end to end: real GSM8K rows, a real Dask LocalCluster with worker processes, the real model.

The end-to-end run starts its own cluster; the flaky-S3, corrupt-file and messages-column runs check what a job
writes, and run on the session's LocalCluster (`shared_cluster`, tests/jobs/conftest.py), its worker put in the
flaky store's environment for the flaky-S3 run (worker_env.workers_in)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner
from worker_env import S3_ENV, workers_in

from engine import EngineConfig
from engine.loading.gguf_native_int4 import gguf_dequantized_note
from engine.loading.model_files import resolve_model_path
from engine.worker.device import resolve_device, resolve_dtype
from jobs.cli import app
from jobs.lease import Lease
from jobs.spec import engine_config, run_config
from pipeline.accounting import quantization_label
from pipeline.config import RunConfig
from pipeline.manifest import pin_manifest
from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA, JobSpec

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


def _default_model_label(dtype: str) -> str:
    """The quantization the default model (SmolLM2-135M-Instruct's Q4_1 GGUF) runs with by default: "none", its
    4-bit weights dequantized to `dtype`, which the label says, counting them (issue 51 item 9)."""
    label = quantization_label("none", gguf_dequantized_note(resolve_model_path(None), dtype))
    assert label.startswith("none (gguf: ") and " Q4_1" in label and f"dequantized to {dtype}; " in label, label
    return label


def _auto_dtype() -> str:
    """The dtype `--dtype auto` runs in on this machine (bfloat16 on CPUs with native bf16, else float32)."""
    return str(resolve_dtype("auto", resolve_device("auto"))).removeprefix("torch.")


@pytest.mark.slow  # the real model (tests/jobs/conftest.py): one real end-to-end run, the default model and dtype
def test_run_end_to_end_every_id_exactly_once(gsm8k_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["run", str(gsm8k_folder), str(out), "--prompt-column", "question", "--rows-per-shard", "8",
            "--max-tokens", "8", "--workers", "2", "--price-per-hour", "1.5", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = _summary(res.stdout)
    assert summary["shards"] == 3 and summary["shards_failed"] == 0
    assert summary["rows_ok"] == 20 and summary["output_tokens"] == 160
    ran = _auto_dtype()
    # what ran: auto resolved, the default quantization (none) with what it did to the GGUF's 4-bit weights
    assert (summary["dtypes"], summary["quantizations"]) == ([ran], [_default_model_label(ran)])
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
               and r["dtype"] == ran and r["quantization"] == _default_model_label(ran) for r in acc.to_pylist())

    manifest = json.loads((out / "_SUCCESS").read_text())
    assert [s["shard_id"] for s in manifest["shards"]] == sorted(acc.column("shard_id").to_pylist())
    assert manifest["summary"]["rows_ok"] == 20
    assert all((out / s["results"]).is_file() for s in manifest["shards"])

    # A rerun into the same OUTPUT, or a submit of the same job as a spec, finds it finished and rewrites nothing.
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*.parquet")}
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "already finished" in again.stderr and _summary(again.stdout)["already_done"] is True
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"input": str(gsm8k_folder), "output": str(out), "columns": {"prompt": "question"},
                                    "sampling": {"max_tokens": 8}, "sharding": {"rows_per_shard": 8}}))
    submitted = runner.invoke(app, ["submit", str(spec), "--json"])
    assert submitted.exit_code == 0, submitted.output
    assert _summary(submitted.stdout)["rows_ok"] == 20 and "already finished" in submitted.stderr
    assert _summary(submitted.stdout)["dtypes"] == [ran]  # read back from the committed accounting
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.parquet")} == mtimes

    # The same OUTPUT with other shards is refused before any work.
    spec.write_text(spec.read_text().replace("rows_per_shard: 8", "rows_per_shard: 4"))
    other = runner.invoke(app, ["submit", str(spec)])
    assert other.exit_code == 2 and "rows_per_shard: the job has 8, this run asks for 4" in other.stderr

    status = runner.invoke(app, ["status", str(out), "--json"])
    assert status.exit_code == 0, status.output
    st = json.loads(status.stdout)
    assert st["state"] == "done" and st["shards"]["done"] == 3 and st["rows_committed"] == 20
    assert st["output_tokens"] == 160 and st["tokens_per_dollar"] > 0 and st["attempts"] == 3
    assert (st["dtypes"], st["quantizations"]) == ([ran], [_default_model_label(ran)])


def test_missing_prompt_column_stops_before_any_work(gsm8k_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(gsm8k_folder), str(out), "--workers", "1"])
    assert res.exit_code == 2
    assert "'prompt' not found" in res.output and "['id', 'question']" in res.output
    assert not out.exists()


def test_corrupt_file_fails_its_shard_only(gsm8k_folder: Path, tmp_path: Path, shared_cluster: str) -> None:
    (gsm8k_folder / "b.parquet").write_bytes(b"PAR1 truncated upload")
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(gsm8k_folder), str(out), "--prompt-column", "question", "--max-tokens", "4",
                              "--scheduler", shared_cluster, "--json"])
    assert res.exit_code == 1
    summary = _summary(res.stdout)
    assert summary["shards_ok"] == 1 and list(summary["failed"]) == ["00001-000000000"]
    assert "b.parquet" in summary["failed"]["00001-000000000"]
    assert pq.read_table(out / "results").num_rows == 14
    assert not (out / "_SUCCESS").exists()  # the job is not done until every shard is

    status = runner.invoke(app, ["status", str(out), "--json"])
    assert status.exit_code == 1  # failed shards, no run holding the job
    st = json.loads(status.stdout)
    assert st["state"] == "failed" and st["shards"]["done"] == 1 and st["shards"]["failed"] == 1
    assert "b.parquet" in st["failed"]["00001-000000000"]
    assert (st["dtypes"], st["quantizations"]) == ([_auto_dtype()], ["none"])  # of the shard that ran
    table = runner.invoke(app, ["status", str(out)])
    assert table.exit_code == 1 and "shard 00001-000000000 failed" in table.stderr
    assert f"{_auto_dtype()} / none" in table.stdout
    assert st["task"] == "generate" and "│ tokens per dollar" in table.stdout  # and every job's input and rows per $
    assert "│ input tokens / rows per dollar" in table.stdout


def test_a_held_lease_or_a_cancel_refuses_the_run_before_any_work(gsm8k_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["run", str(gsm8k_folder), str(out), "--prompt-column", "question", "--max-tokens", "4"]
    with Lease(str(out), ttl_s=60, holder="other-host:123:abcd"):
        res = runner.invoke(app, args)
        assert res.exit_code == 3
        assert "another run holds the job" in res.stderr and "other-host:123:abcd" in res.stderr
        status = runner.invoke(app, ["status", str(out)])
        assert status.exit_code == 2 and "no tokenmill job" in status.stderr  # nothing pinned yet
    assert not (out / "results").exists()

    assert runner.invoke(app, ["cancel", str(out)]).exit_code == 2  # no job there yet
    pin_manifest(str(out), str(gsm8k_folder), RunConfig(prompt_column="question", max_tokens=4))
    cancelled = runner.invoke(app, ["cancel", str(out), "--reason", "wrong model"])
    assert cancelled.exit_code == 0 and "cancelled the job" in cancelled.stderr
    assert json.loads((out / "_CANCEL").read_text())["reason"] == "wrong model"
    assert "already cancelled" in runner.invoke(app, ["cancel", str(out)]).stderr
    res = runner.invoke(app, args)
    assert res.exit_code == 4 and "was cancelled" in res.stderr and "--resume" in res.stderr
    st = json.loads(runner.invoke(app, ["status", str(out), "--json"]).stdout)
    assert st["state"] == "cancelled" and st["exit_code"] == 4 and st["shards"]["pending"] == 2


@pytest.mark.parametrize(("flags", "doc"), [
    (["--top-p", "1.5"], {"sampling": {"top_p": 1.5}}),
    (["--max-tokens", "0"], {"sampling": {"max_tokens": 0}}),
    (["--stop", ""], {"sampling": {"stop": [""]}}),
    (["--prompt-column", ""], {"columns": {"prompt": ""}}),
    (["--quantization", "bogus"], {"engine": {"quantization": "bogus"}}),
    (["--dtype", "fp8"], {"engine": {"dtype": "fp8"}}),
    (["--device", "gpu"], {"engine": {"device": "gpu"}}),
    (["--kv-cache-gib", "0"], {"engine": {"kv_cache_gib": 0.0}}),
    (["--scheduler", "dask:8786"], {"cluster": {"scheduler": "dask:8786"}}),
    (["--limit", "0"], {"sharding": {"limit": 0}}),
])
def test_run_and_submit_reject_a_bad_value_with_the_same_message(gsm8k_folder: Path, tmp_path: Path,
                                                                 flags: list[str], doc: dict) -> None:
    """Both commands validate through the one job spec model: the same bad value is refused (exit 2) before any
    work with the same problem line, naming the field, the option and what it accepts."""
    out = tmp_path / "o"
    ran = runner.invoke(app, ["run", str(gsm8k_folder), str(out), *flags])
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"input": str(gsm8k_folder), "output": str(out), **doc}))
    submitted = runner.invoke(app, ["submit", str(spec)])

    def problems(stderr: str) -> list[str]:
        return [line for line in stderr.splitlines() if line.startswith("  - ")]

    assert ran.exit_code == submitted.exit_code == 2, (ran.output, submitted.output)
    assert problems(ran.stderr) == problems(submitted.stderr) and len(problems(ran.stderr)) == 1, (
        ran.stderr, submitted.stderr)
    section, (key, value) = next(iter(doc.items())), next(iter(next(iter(doc.values())).items()))
    line = problems(ran.stderr)[0]
    assert f"{section[0]}.{key} ({flags[0]})" in line and "Expected:" in line and repr(value).strip("[]") in line
    assert not out.exists()  # refused before any work


def test_submit_overrides_are_validated_like_the_spec(gsm8k_folder: Path, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"input": str(gsm8k_folder), "output": str(tmp_path / "o")}))
    res = runner.invoke(app, ["submit", str(spec), "--scheduler", "dask:8786"])
    assert res.exit_code == 2 and "cluster.scheduler (--scheduler): String should match pattern" in res.stderr


def test_messages_column_input(tmp_path: Path, data_dir: Path, shared_cluster: str) -> None:
    qs = pq.read_table(data_dir / "alpaca_eval.parquet", columns=["instruction"]).column("instruction")
    msgs = [[{"role": "user", "content": q}] for q in qs.to_pylist()[:4]]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    res = runner.invoke(app, ["run", str(tmp_path / "chat.parquet"), str(tmp_path / "o"), "--max-tokens", "4",
                              "--scheduler", shared_cluster, "--json"])
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "o" / "results").column("id").to_pylist() == ["0", "1", "2", "3"]


def test_s3_to_s3_on_a_flaky_store_every_id_exactly_once(data_dir: Path, shared_cluster: str) -> None:
    """`tokenmill run s3://... s3://...` against an S3 that refuses ~15% of requests (503 SlowDown / 500) and loses
    the answer to ~5% of PUTs after they landed; botocore's retries are off, so tokenmill's own retries carry it, in
    the client and in the worker (the session's, put in the flaky store's environment: worker_env.workers_in)."""
    import fsspec
    from s3_faults import flaky_s3

    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(300, 16)
    with flaky_s3(rate=0.15, lost_rate=0.05, seed=11) as s3:
        fs = fsspec.filesystem("s3")
        s3.faults.enabled = False
        for name, part in [("a", table.slice(0, 10)), ("b", table.slice(10, 6))]:
            with fs.open(f"{s3.bucket}/in/{name}.parquet", "wb") as f:
                pq.write_table(part, f)
        s3.faults.enabled = True
        with workers_in(shared_cluster, env=S3_ENV):
            res = runner.invoke(app, ["run", f"s3://{s3.bucket}/in/", f"s3://{s3.bucket}/out", "--prompt-column",
                                      "question", "--rows-per-shard", "8", "--max-tokens", "6", "--checkpoint-rows",
                                      "3", "--scheduler", shared_cluster, "--json"])
        stats = s3.faults.stats
        s3.faults.enabled = False
        assert res.exit_code == 0, res.output
        assert _summary(res.stdout)["rows_ok"] == 16
        results = pa.concat_tables(pq.read_table(fs.open(p, "rb"))
                                   for p in sorted(fs.glob(f"{s3.bucket}/out/results/*")))
        assert sorted(results.column("id").to_pylist()) == sorted(table.column("id").to_pylist())
        assert len(fs.glob(f"{s3.bucket}/out/accounting/*.parquet")) == 3
        assert fs.exists(f"{s3.bucket}/out/_SUCCESS") and fs.exists(f"{s3.bucket}/out/_manifest/input.json")
    assert stats.faults >= 5, stats


def test_spec_defaults_are_the_pipeline_and_engine_defaults() -> None:
    """schemas.JobSpec (the one definition of a job's options) builds exactly the pipeline's and the engine's
    default configs (EngineConfig lives in the engine, which imports no schemas), or a spec and a plain
    `tokenmill run` would run different jobs."""
    spec = JobSpec(input="in/", output="out/")
    assert run_config(spec) == RunConfig()
    assert engine_config(spec) == EngineConfig()
    assert engine_config(JobSpec.from_options(input="in/", output="out/", quantization="int8")).quantization == "int8"


def test_submit_takes_the_tokenmill_variables_as_run_does(gsm8k_folder: Path, tmp_path: Path) -> None:
    """TOKENMILL_* variables reached `run` but not `submit` (issue 31): now each overrides the spec's value and a bad
    one is refused before any work, naming the variable, as `run` names it."""
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"input": str(gsm8k_folder), "output": str(tmp_path / "o"),
                                    "engine": {"dtype": "float32", "max_num_seqs": 4}}))
    env = {"TOKENMILL_DTYPE": "float64", "TOKENMILL_MODEL": None}
    submitted = runner.invoke(app, ["submit", str(spec)], env=env)
    ran = runner.invoke(app, ["run", str(gsm8k_folder), str(tmp_path / "o")], env=env)
    assert submitted.exit_code == ran.exit_code == 2, (submitted.output, ran.output)
    for res in (submitted, ran):
        assert "engine.dtype (--dtype, set by the environment variable TOKENMILL_DTYPE)" in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()
    res = runner.invoke(app, ["submit", str(spec), "--max-num-seqs", "0"], env={"TOKENMILL_MODEL": None})
    assert res.exit_code == 2 and "engine.max_num_seqs (--max-num-seqs)" in res.stderr, res.stderr


def test_cluster_options_are_the_spec_cluster_section() -> None:
    """ClusterOptions (run_job's) used to repeat the spec's defaults and ranges: now it takes both from
    schemas.job_spec.Cluster, so run_job refuses what a spec refuses."""
    from jobs.cluster import ClusterOptions
    from jobs.errors import JobError
    from schemas.job_spec import Cluster

    opts, spec = ClusterOptions(), Cluster()
    assert (opts.workers, opts.gpus_per_worker) == (spec.workers, spec.gpus_per_worker)
    for bad, field in (({"workers": 0}, "cluster.workers"), ({"gpus_per_worker": -1}, "cluster.gpus_per_worker"),
                       ({"scheduler_address": "dask:8786"}, "cluster.scheduler")):
        with pytest.raises(JobError, match=field) as e:
            ClusterOptions(**bad)
        assert e.value.exit_code == 2


def test_the_readmes_exit_code_table_has_every_code_and_command() -> None:
    """README's exit-codes table: a row for every EXIT_* code of jobs.errors, and a column for every command that
    exits with a code of its own (before: run/submit and status only; export's 1 and the others' 2 were unlisted)."""
    import re

    import jobs.errors as errors

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("  | code |"):]
    table = table[:table.index("\n\n")]
    header, _, *rows = table.splitlines()
    assert all(f"`{c}`" in header for c in ("run", "submit", "status", "cancel", "export", "report", "quantize",
                                            "perplexity"))
    listed = {int(c) for row in rows for c in re.findall(r"\d+", row.split("|")[1])}
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_")}
    assert codes <= listed, codes - listed
    assert all(row.count("|") == header.count("|") for row in rows)  # every row fills every column
