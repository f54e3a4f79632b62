"""An S3 OUTPUT the user may not write (a real bucket policy on moto's S3 server, enforced on every PutObject): one
line naming the object, the operation and the credential (never the secret), exit 2 before any engine work when the
job's first write is refused; a failed shard whose attempt is billed when only results/ is refused, and a rerun
after the policy is lifted that takes the checkpointed rows.

The failed run and its rerun run on the session's LocalCluster (`shared_cluster`, tests/jobs/conftest.py), its
worker put in the test's S3 environment for the test (it reads and writes that S3 with the test's credentials): the
two runs check what a job writes and bills, not their own cluster."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner
from worker_env import S3_ENV, workers_in

import jobs.runner
from jobs.cli import app

runner = CliRunner()
SECRET = "tokenmill-test-secret-never-printed"


@pytest.fixture()
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A moto S3 server (no faults) with a bucket, and a secret key distinct from the key id (to see it is never
    printed)."""
    from s3_faults import flaky_s3

    with flaky_s3(rate=0.0, lost_rate=0.0) as store:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        fsspec.filesystem("s3").clear_instance_cache()
        yield store


@pytest.fixture()
def s3_cluster(s3: object, shared_cluster: str) -> Iterator[str]:
    """The session's LocalCluster (`shared_cluster`, tests/jobs/conftest.py) with its worker in the `s3` fixture's
    environment (worker_env.workers_in) for the test; yields its scheduler address. A cluster of its own started in
    that environment would add only its start-up and model load (about 5 CPU-s)."""
    with workers_in(shared_cluster, env=S3_ENV):
        yield shared_cluster


def _deny_puts(bucket: str, prefix: str) -> None:
    """A bucket policy that denies s3:PutObject under `prefix` to everyone."""
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject",
                                                      "Resource": f"arn:aws:s3:::{bucket}/{prefix}*"}]}
    fsspec.filesystem("s3").call_s3("put_bucket_policy", Bucket=bucket, Policy=json.dumps(policy))


def _input(tmp_path: Path, data_dir: Path, rows: int) -> str:
    src = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(40, rows), src)
    return str(src)


def test_a_read_only_s3_output_is_exit_2_naming_object_operation_and_credential(
        s3: object, tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3.bucket  # type: ignore[attr-defined]
    _deny_puts(bucket, "out/")

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine's work started although OUTPUT cannot be written")

    monkeypatch.setattr(jobs.runner, "run_on_cluster", no_engine)
    res = runner.invoke(app, ["run", _input(tmp_path, data_dir, 4), f"s3://{bucket}/out", "--prompt-column",
                              "question", "--max-tokens", "2"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: access denied: s3:PutObject on s3://"), res.output
    assert f"s3://{bucket}/out/_lease/" in lines[0]  # the object refused
    assert "access key id testing (from environment variables" in lines[0]
    assert SECRET not in res.output and "internal error" not in res.output and "bug" not in res.output
    assert fsspec.filesystem("s3").find(f"{bucket}/out") == []  # nothing left behind


def test_writes_refused_under_results_fail_the_shard_naming_the_object_and_bill_it(
        s3: object, s3_cluster: str, tmp_path: Path, data_dir: Path) -> None:
    bucket = s3.bucket  # type: ignore[attr-defined]
    _deny_puts(bucket, "out/results/")
    src = _input(tmp_path, data_dir, 8)
    args = ["run", src, f"s3://{bucket}/out", "--prompt-column", "question", "--max-tokens", "3",
            "--checkpoint-rows", "4", "--scheduler", s3_cluster, "--price-per-hour", "7.5", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    (error,) = summary["failed"].values()
    assert error.startswith(f"access denied: s3:PutObject on s3://{bucket}/out/results/"), error
    assert "8 rows are checkpointed" in error and SECRET not in res.output
    # The attempt ran: its device-seconds are on the bill, not 0.
    assert summary["device_s"] > 0 and summary["cost_usd"] > 0 and summary["attempts"] == 1
    # One bill, to the rounding of the summary's figures (device_s to 1 ms: 1.1e-6 USD at $7.5/h; cost_usd to 1e-6).
    assert summary["cost_usd"] == pytest.approx(summary["device_s"] / 3600 * 7.5, rel=1e-3, abs=2.1e-6)
    # One bill, whichever command shows it (issue 51): status bills the failed shard as the run's summary did, at
    # the price that run ran at.
    status = json.loads(runner.invoke(app, ["status", f"s3://{bucket}/out", "--json"]).stdout)
    assert status["state"] == "failed" and status["cost_usd"] == summary["cost_usd"]
    assert status["device_s_unfinished"] == summary["device_s"]

    fsspec.filesystem("s3").call_s3("delete_bucket_policy", Bucket=bucket)
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout.strip().splitlines()[-1])
    assert again["rows_ok"] == 8 and again["run_rows"] == 0  # every row from the checkpoints, none generated again
