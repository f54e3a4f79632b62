"""Bad inputs a new user tries, each on real GSM8K rows: a clear message, the right exit code, nothing lost, nothing
wrongly marked done (issue 16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_worker_cli import DASK_CONFIG, ROOT, WAIT_S, dask_cli_cluster
from typer.testing import CliRunner

from jobs.cli import app

runner = CliRunner()


@pytest.fixture()
def gsm8k_rows(tmp_path: Path, data_dir: Path) -> Path:
    """6 real GSM8K questions with ids '1', null, '1', '4', '5', '6': a null id and a repeated one."""
    t = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question"]).slice(200, 6)
    path = tmp_path / "in" / "gsm8k.parquet"
    path.parent.mkdir()
    pq.write_table(t.append_column("id", pa.array(["1", None, "1", "4", "5", "6"])), path)
    return path


def _tokenmill(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=WAIT_S)


def test_relative_output_on_a_cluster_whose_workers_run_elsewhere(gsm8k_rows: Path, tmp_path: Path) -> None:
    """`--scheduler` with a relative OUTPUT: the workers of a real `dask scheduler` / `dask worker` started in
    another working directory write where the client means, _SUCCESS is committed beside the results, and `status`
    agrees. Results keep the null id null and tell the two rows with id '1' apart by input_row; the summary counts
    them. Before: results under the workers' folder, _SUCCESS under the client's, `status` said done with 0 rows."""
    client_dir, worker_dir = tmp_path / "client", tmp_path / "workers"
    client_dir.mkdir()
    worker_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               DASK_CONFIG=str(DASK_CONFIG))
    with dask_cli_cluster(env, tmp_path / "dask.log", workers=1, cwd=worker_dir) as (address, _):
        run = _tokenmill(["run", str(gsm8k_rows), "out", "--prompt-column", "question", "--max-tokens", "8",
                          "--rows-per-shard", "3", "--device", "cpu", "--scheduler", address, "--json"],
                         client_dir, env)
    assert run.returncode == 0, run.stderr
    assert not (worker_dir / "out").exists()
    out = client_dir / "out"
    assert (out / "_SUCCESS").is_file()
    results = pq.read_table(out / "results").sort_by("input_row")
    assert results.column("id").to_pylist() == ["1", None, "1", "4", "5", "6"]
    assert results.column("input_row").to_pylist() == list(range(6))
    assert set(results.column("input_file").to_pylist()) == {gsm8k_rows.as_uri()}
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert (summary["rows_ok"], summary["ids_null"], summary["ids_repeated"]) == (6, 1, 2)
    assert "2 result rows share their id" in run.stderr and "input_file + input_row" in run.stderr
    status = _tokenmill(["status", "out", "--json"], client_dir, env)
    assert status.returncode == 0 and json.loads(status.stdout)["rows_committed"] == 6


def test_a_prompt_column_of_the_wrong_type_stops_the_job_before_any_work(tmp_path: Path, data_dir: Path) -> None:
    ids = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id"]).slice(0, 4).column("id")
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"id": ids, "question": pa.array([1, 2, 3, 4], pa.int64())}), path)
    res = runner.invoke(app, ["run", str(path), str(tmp_path / "out"), "--prompt-column", "question"])
    assert res.exit_code == 2
    assert "holds int64, not text" in res.stderr and "cast" in res.stderr.lower()
    assert not (tmp_path / "out").exists()


def test_a_missing_or_non_gguf_model_is_refused_before_the_job(gsm8k_rows: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    missing = runner.invoke(app, ["run", str(gsm8k_rows), str(out), "--prompt-column", "question",
                                  "--model", "/nonexistent.gguf"])
    assert missing.exit_code == 2 and "/nonexistent.gguf does not exist" in missing.stderr
    assert "--model" in missing.stderr and not out.exists()
    not_gguf = runner.invoke(app, ["run", str(gsm8k_rows), str(out), "--prompt-column", "question",
                                   "--model", str(gsm8k_rows)])
    assert not_gguf.exit_code == 2 and "is not a GGUF file" in not_gguf.stderr and "PAR1" in not_gguf.stderr
    assert not out.exists()
    folder = runner.invoke(app, ["run", str(gsm8k_rows), str(out), "--prompt-column", "question",
                                 "--model", str(tmp_path)])
    assert folder.exit_code == 2 and "not a tokenmill model folder" in folder.stderr and not out.exists()


def test_an_output_that_is_a_file_or_not_writable_is_a_clear_error(gsm8k_rows: Path, tmp_path: Path) -> None:
    as_file = tmp_path / "results.txt"
    as_file.write_text("not a folder")
    res = runner.invoke(app, ["run", str(gsm8k_rows), str(as_file), "--prompt-column", "question"])
    assert res.exit_code == 2 and "is an existing file, not a folder" in res.stderr
    assert res.exception is None or isinstance(res.exception, SystemExit)  # no traceback
    below = runner.invoke(app, ["run", str(gsm8k_rows), str(as_file / "out"), "--prompt-column", "question"])
    assert below.exit_code == 2 and f"{as_file} is a file, not a folder" in below.stderr
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: the read-only folder case needs another user")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        res = runner.invoke(app, ["run", str(gsm8k_rows), str(locked / "out"), "--prompt-column", "question"])
    finally:
        locked.chmod(0o755)
    assert res.exit_code == 2 and "is not writable" in res.stderr
