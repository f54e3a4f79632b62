"""Object storage that must never surprise: a missing bucket is refused (never created), an endpoint where nothing
listens is one line naming it and the variable that set it, and a shard reads exactly the input version its job
pinned (S3 version id on a versioned bucket, If-Match on the ETag otherwise; fstat on a local file). Real moto S3
server, real `tokenmill run` processes, real GSM8K rows."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import boto3
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.input import InputChanged, Shard, file_version, open_pinned
from pipeline.shard import read_shard
from pipeline.storage import check_bucket, commit_json, output_fs
from pipeline.store_reach import unreachable_store

ROOT = Path(__file__).resolve().parents[2]


def _client(endpoint: str):  # noqa: ANN202 (boto3's client type is generated)
    return boto3.client("s3", endpoint_url=endpoint)


def _rows(data_dir: Path, start: int, n: int = 8) -> pa.Table:
    return pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(start, n)


def _put(endpoint: str, bucket: str, key: str, table: pa.Table) -> None:
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    with fs.open(f"{bucket}/{key}", "wb") as f:
        pq.write_table(table, f)


def _tokenmill(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], env=dict(env or os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)


def _buckets(endpoint: str) -> set[str]:
    return {b["Name"] for b in _client(endpoint).list_buckets()["Buckets"]}


def test_a_missing_output_bucket_is_refused_and_never_created(s3_endpoint: str, tmp_path: Path, data_dir: Path) -> None:
    rows = tmp_path / "in.parquet"
    pq.write_table(_rows(data_dir, 0), rows)
    res = _tokenmill("run", str(rows), "s3://nosuchbucket/out/", "--prompt-column", "question", "--limit", "2")
    assert res.returncode == 2, res.stderr
    assert "'nosuchbucket'" in res.stderr and "does not exist" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert "nosuchbucket" not in _buckets(s3_endpoint)
    # The class, not the example: no write path creates a bucket either.
    fs, root = output_fs("s3://nosuchbucket-either/job")
    with pytest.raises(FileNotFoundError):
        commit_json(fs, f"{root}/_lease/000000000000.json", {"holder": "x"})
    with pytest.raises(FileNotFoundError, match="nosuchbucket-either"):
        check_bucket("s3://nosuchbucket-either/job")
    assert not {"nosuchbucket", "nosuchbucket-either"} & _buckets(s3_endpoint)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_an_endpoint_where_nothing_listens_is_one_line_naming_it(tmp_path: Path, data_dir: Path) -> None:
    """INPUT on S3 with AWS_ENDPOINT_URL, OUTPUT on S3 with FSSPEC_S3_ENDPOINT_URL: exit 2 after a few tries, one
    line with the endpoint and the variable, no traceback, nothing written.

    The two `tokenmill run` processes run side by side: each waits between its tries (store_reach.PROBE_WAIT_S),
    and one's waits are the other's start-up rather than idle time. Neither is timed."""
    rows = tmp_path / "in.parquet"
    pq.write_table(_rows(data_dir, 0), rows)
    runs = {}
    for variable in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        endpoint = f"http://127.0.0.1:{_closed_port()}"
        env = {k: v for k, v in os.environ.items() if k not in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL")}
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                   PYTHONPATH=str(ROOT))
        env[variable] = endpoint
        out = tmp_path / variable / "out"
        if variable == "AWS_ENDPOINT_URL":
            args = ["s3://bucket/in.parquet", str(out)]
        else:
            args = [str(rows), "s3://bucket/out/"]
        proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", *args, "--prompt-column", "question"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        runs[variable] = (endpoint, out, proc)
    try:
        stderrs = {variable: proc.communicate(timeout=300)[1] for variable, (_, _, proc) in runs.items()}
    finally:
        for _, _, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for variable, (endpoint, out, proc) in runs.items():
        stderr = stderrs[variable]
        assert proc.returncode == 2, (variable, stderr)
        line = stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in line, line
        assert endpoint in line and variable in line, line
        assert ("INPUT" if variable == "AWS_ENDPOINT_URL" else "OUTPUT") in line, line
        assert not out.exists() and not out.parent.exists()


def test_botocore_connection_errors_are_recognised_through_their_causes() -> None:
    from botocore.exceptions import EndpointConnectionError

    try:
        try:
            raise EndpointConnectionError(endpoint_url="http://10.1.2.3:9000/bucket?list-type=2", error="refused")
        except EndpointConnectionError as e:
            raise OSError("listing failed") from e
    except OSError as wrapped:
        line = unreachable_store(wrapped)
    assert line is not None and "http://10.1.2.3:9000" in line and "list-type" not in line
    assert unreachable_store(FileNotFoundError("nope")) is None


def test_s3_reads_exactly_the_pinned_version_or_fail_as_input_changed(s3_endpoint: str, data_dir: Path) -> None:
    """Unversioned bucket: a pinned ETag that no longer matches is InputChanged before the read, and an overwrite
    after the open fails the read (If-Match) instead of mixing two versions, which read_shard reports as
    InputChanged."""
    _client(s3_endpoint).create_bucket(Bucket="plain")
    old, new = _rows(data_dir, 0), _rows(data_dir, 100)
    _put(s3_endpoint, "plain", "in.parquet", old)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    pinned = file_version(fs, "plain/in.parquet")
    url = "s3://plain/in.parquet"
    with open_pinned(url, pinned) as f:
        assert pq.read_table(f).equals(old)
    # s3fs's FileExpired: the If-Match failed
    with pytest.raises(Exception) as caught, open_pinned(url, pinned) as f:  # noqa: PT011
        _put(s3_endpoint, "plain", "in.parquet", new)  # another ETag
        pq.read_table(f)
    assert type(caught.value).__name__ == "FileExpired"
    with pytest.raises(InputChanged, match="input changed since the job pinned it"), open_pinned(url, pinned):
        pass
    shard = Shard("00000-000000000", "plain/in.parquet", url, 0, 8)
    with pytest.raises(InputChanged, match=r"s3://plain/in.parquet was \d+ bytes"):
        read_shard(shard, "question", "id", pinned=pinned)
    now = file_version(fs, "plain/in.parquet")
    assert read_shard(shard, "question", "id", pinned=now).prompts == new.column("question").to_pylist()


def test_a_versioned_bucket_is_read_by_the_checked_version_id(s3_endpoint: str, data_dir: Path) -> None:
    """With versioning, the checked version is read by its VersionId: an overwrite after the check changes
    nothing of what the shard reads."""
    client = _client(s3_endpoint)
    client.create_bucket(Bucket="versioned")
    client.put_bucket_versioning(Bucket="versioned", VersioningConfiguration={"Status": "Enabled"})
    old, new = _rows(data_dir, 0), _rows(data_dir, 200)
    _put(s3_endpoint, "versioned", "in.parquet", old)
    pinned = file_version(fsspec.filesystem("s3", skip_instance_cache=True), "versioned/in.parquet")
    with open_pinned("s3://versioned/in.parquet", pinned) as f:
        _put(s3_endpoint, "versioned", "in.parquet", new)
        assert pq.read_table(f).equals(old)
    versions = client.list_object_versions(Bucket="versioned", Prefix="in.parquet")["Versions"]
    assert len(versions) == 2


def test_a_local_input_is_read_from_the_checked_file(tmp_path: Path, data_dir: Path) -> None:
    """A file renamed over the input after the check cannot reach the open file; one written in place fails the
    read as InputChanged; a stale pin fails before the read."""
    path = tmp_path / "in.parquet"
    old, new = _rows(data_dir, 0), _rows(data_dir, 300)
    pq.write_table(old, path)
    pinned = file_version(fsspec.filesystem("file"), str(path))
    with open_pinned(str(path), pinned) as f:
        pq.write_table(new, tmp_path / "next.parquet")
        os.replace(tmp_path / "next.parquet", path)
        assert pq.read_table(f).equals(old)
    with pytest.raises(InputChanged, match="since the job pinned it"), open_pinned(str(path), pinned):
        pass
    pinned = file_version(fsspec.filesystem("file"), str(path))
    with pytest.raises(InputChanged, match="while it was read"), open_pinned(str(path), pinned) as f:
        pq.read_table(f)
        with open(path, "r+b") as w:  # written in place while the shard reads it
            w.write(b"PAR1")
        os.utime(path, ns=(1, 1))
