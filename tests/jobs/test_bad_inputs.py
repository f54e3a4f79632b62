"""Bad inputs a new user tries, each on real GSM8K rows: a clear message, the right exit code, nothing lost, nothing
wrongly marked done (issue 16)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner
from worker_env import workers_in

from jobs.cli import app
from jobs.runner import _repin_unstarted_inputs
from pipeline.config import RunConfig
from pipeline.manifest import pin_manifest, read_manifest

runner = CliRunner()


@pytest.fixture()
def gsm8k_rows(tmp_path: Path, data_dir: Path) -> Path:
    """6 real GSM8K questions with ids '1', null, '1', '4', '5', '6': a null id and a repeated one."""
    t = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question"]).slice(200, 6)
    path = tmp_path / "in" / "gsm8k.parquet"
    path.parent.mkdir()
    pq.write_table(t.append_column("id", pa.array(["1", None, "1", "4", "5", "6"])), path)
    return path


def test_relative_output_on_a_cluster_whose_workers_run_elsewhere(gsm8k_rows: Path, tmp_path: Path,
                                                                   shared_cluster: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`--scheduler` with a relative OUTPUT: the workers of a cluster that run in another working directory write
    where the client means, _SUCCESS is committed beside the results, and `status` agrees. Results keep the null id
    null and tell the two rows with id '1' apart by input_row; the summary counts them. Before: results under the
    workers' folder, _SUCCESS under the client's, `status` said done with 0 rows.

    The client is this process, in its own working directory (monkeypatch.chdir); the workers are the session's
    LocalCluster's (`shared_cluster`, tests/jobs/conftest.py), moved into a folder of their own for the run and back
    after it (worker_env.workers_in): a cluster of its own would add only its processes' start-up and model load
    (about 5 CPU-s)."""
    client_dir, worker_dir = tmp_path / "client", tmp_path / "workers"
    client_dir.mkdir()
    worker_dir.mkdir()
    monkeypatch.chdir(client_dir)
    with workers_in(shared_cluster, cwd=str(worker_dir)):
        run = runner.invoke(app, ["run", str(gsm8k_rows), "out", "--prompt-column", "question", "--max-tokens", "8",
                                  "--rows-per-shard", "3", "--device", "cpu", "--scheduler", shared_cluster, "--json"])
    assert run.exit_code == 0, run.output
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
    status = runner.invoke(app, ["status", "out", "--json"])
    assert status.exit_code == 0 and json.loads(status.stdout)["rows_committed"] == 6


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


def _snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    """Every committed object under OUTPUT (the lease's renewals aside): path -> (mtime ns, content)."""
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*")
            if p.is_file() and "_lease" not in p.parts}


def test_a_corrupt_file_fixed_or_removed_lets_the_job_finish_in_place(
        tmp_path: Path, data_dir: Path, shared_cluster: str, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Three GSM8K files, two of them corrupt (text named .parquet, a truncated file): the good file's shard commits,
    each bad one fails with its file and problem named, no Dask traceback, attempts counted, exit 1. Then one is
    fixed and the other removed: the same command finishes the job in place (new manifest revision, the first one
    untouched), every id once, nothing committed rewritten. Before: InputChanged forever, "attempts 0", and a raw
    "Compute Failed" traceback from the worker.

    The failing run starts its own cluster from this process, whose stderr its worker processes share: what they
    print is read at the file descriptor (capfd) with the client's own (no traceback from either), as a child
    process's stderr would hold both without its start-up and imports. The rerun's checks are the client's summary
    and files, so it runs on the session's LocalCluster (`shared_cluster`, tests/jobs/conftest.py)."""
    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(300, 6)
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(table.slice(0, 2), inp / "a.parquet")
    (inp / "b.parquet").write_text("question,id\nnot a parquet file\n")
    pq.write_table(table.slice(4, 2), tmp_path / "c.parquet")
    (inp / "c.parquet").write_bytes((tmp_path / "c.parquet").read_bytes()[:-40])  # truncated: no footer
    args = ["run", "in", "out", "--prompt-column", "question", "--max-tokens", "2", "--device", "cpu", "--json"]
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    first = runner.invoke(app, args)
    stderr = first.stderr + capfd.readouterr().err  # the client's, then its workers' (and its cluster's)
    assert first.exit_code == 1, stderr
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["shards_ok"] == 1 and set(summary["failed"]) == {"00001-000000000", "00002-000000000"}
    assert "in/b.parquet: Parquet magic bytes not found" in summary["failed"]["00001-000000000"]
    assert "in/c.parquet" in summary["failed"]["00002-000000000"]
    assert all("Fix or remove the file" in e for e in summary["failed"].values())
    assert summary["attempts"] == 3  # one each, the failed ones included
    assert first.exception is None or isinstance(first.exception, SystemExit), first.exception  # none raised
    assert "Compute Failed" not in stderr and "Traceback" not in stderr, stderr
    out = tmp_path / "out"
    before = _snapshot(out)
    assert "results/00000-000000000.parquet" in before

    pq.write_table(table.slice(2, 2), inp / "b.parquet")  # fixed
    (inp / "c.parquet").unlink()  # removed
    again = runner.invoke(app, [*args, "--scheduler", shared_cluster])
    assert again.exit_code == 0, again.output
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["shards"] == 2 and not summary["failed"]
    assert sorted(summary["repinned"]) == [(inp / "b.parquet").as_uri(), (inp / "c.parquet").as_uri()]
    assert "re-pinned it as it is now" in again.stderr
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before  # nothing committed rewritten
    assert (out / "_manifest" / "input-001.json").is_file() and (out / "_SUCCESS").is_file()
    results = pq.read_table(out / "results")
    assert sorted(results.column("id").to_pylist()) == sorted(table.slice(0, 4).column("id").to_pylist())


def test_only_files_with_nothing_committed_are_re_pinned(tmp_path: Path, data_dir: Path) -> None:
    """A changed file with committed rows stays pinned (its unfinished shards fail: their rows would mix two
    contents); a changed file with nothing committed is re-pinned in a new manifest revision, the first kept as is;
    a re-pin that would move other files' shards (--limit) is refused."""
    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(0, 8)
    inp, out = tmp_path / "in", str(tmp_path / "out")
    inp.mkdir()
    for name, start in (("a", 0), ("b", 4)):
        pq.write_table(table.slice(start, 4), inp / f"{name}.parquet")
    cfg = RunConfig(prompt_column="question", rows_per_shard=2)
    manifest, _ = pin_manifest(out, str(inp), cfg)
    first = (tmp_path / "out" / "_manifest" / "input.json").read_bytes()
    (tmp_path / "out" / "results").mkdir()
    (tmp_path / "out" / "results" / "00000-000000000.parquet").write_bytes(b"committed")  # a's first shard
    for name in ("a", "b"):
        pq.write_table(table.slice(0, 3), inp / f"{name}.parquet")
    revised, repinned, kept = _repin_unstarted_inputs(out, manifest, cfg)
    assert repinned == [(inp / "b.parquet").as_uri()] and list(kept) == [(inp / "a.parquet").as_uri()]
    assert "rows of it are committed" in kept[(inp / "a.parquet").as_uri()]
    assert revised.revision == 1 and read_manifest(out) == revised
    assert [s.shard_id for s in revised.shards()] == ["00000-000000000", "00000-000000002", "00001-000000000",
                                                      "00001-000000002"]
    assert (tmp_path / "out" / "_manifest" / "input.json").read_bytes() == first

    limited = str(tmp_path / "limited")
    cfg = RunConfig(prompt_column="question", rows_per_shard=2, limit=5)
    manifest, _ = pin_manifest(limited, str(inp), cfg)  # a: 3 rows, b: 2 (the limit)
    pq.write_table(table.slice(0, 4), inp / "a.parquet")  # a now has 4 rows: b's shard would hold 1, not 2
    again, repinned, kept = _repin_unstarted_inputs(limited, manifest, cfg)
    assert again == manifest and not repinned and "would move the shards of" in kept[(inp / "a.parquet").as_uri()]
