"""Create-only commits, locally and on S3 (moto); shards from S3 to S3 and checkpointed on S3, on the real engine."""

from __future__ import annotations

import errno
import io
import threading
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from shard_helpers import ROWS, CountingEngine, interrupt_after, shard_cfg

from engine import LLMEngine
from pipeline.checkpoint import committed_parts
from pipeline.config import RunConfig
from pipeline.input import Shard, plan_shards, resolve_inputs, validate_columns
from pipeline.layout import accounting_path, results_path
from pipeline.shard import run_shard
from pipeline.status import shard_state
from pipeline.storage import commit_table, is_transient, output_fs, read_table
from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA


def _table(data_dir: Path, n: int) -> pa.Table:
    return pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(200, n)


def test_local_commit_is_create_only(tmp_path: Path, data_dir: Path) -> None:
    fs, root = output_fs(str(tmp_path / "out"))
    path = f"{root}/results/00000-000000000.parquet"
    first, second = _table(data_dir, 3), _table(data_dir, 5)
    assert commit_table(fs, path, first) is True
    assert commit_table(fs, path, second) is False  # a retry finds it committed and leaves it alone
    assert read_table(fs, path).equals(first)


def test_s3_commit_is_create_only(s3_bucket: str, data_dir: Path) -> None:
    fs, root = output_fs(f"s3://{s3_bucket}/create-only")
    path = f"{root}/accounting/x.parquet"
    first = _table(data_dir, 2)
    assert commit_table(fs, path, first) is True
    assert commit_table(fs, path, _table(data_dir, 4)) is False  # If-None-Match: * refused the overwrite
    assert read_table(fs, path).equals(first)


def test_shard_from_s3_to_s3(engine: LLMEngine, s3_bucket: str, data_dir: Path) -> None:
    table = _table(data_dir, 10)
    with fsspec.open(f"s3://{s3_bucket}/in/gsm8k.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=3)
    cfg = RunConfig(prompt_column="question", rows_per_shard=6, max_tokens=4)
    fs, files = resolve_inputs(f"s3://{s3_bucket}/in/")
    shards = plan_shards(fs, files, cfg)
    assert [(s.url, s.row_start, s.row_end) for s in shards] == [
        (f"s3://{s3_bucket}/in/gsm8k.parquet", 0, 6), (f"s3://{s3_bucket}/in/gsm8k.parquet", 6, 10)]
    column = validate_columns(fs, files, cfg)
    out = f"s3://{s3_bucket}/out"
    accts = [run_shard(engine, s, column, out, cfg) for s in shards]

    ofs, root = output_fs(out)
    results = pa.concat_tables(read_table(ofs, results_path(root, s.shard_id)) for s in shards)
    assert results.schema.equals(RESULTS_SCHEMA, check_metadata=False)
    assert results.column("id").to_pylist() == table.column("id").to_pylist()
    assert set(results.column("finish_reason").to_pylist()) <= {"stop", "length"}
    for s, a in zip(shards, accts, strict=True):
        committed = read_table(ofs, accounting_path(root, s.shard_id, 1))
        assert committed.schema.equals(ACCOUNTING_SCHEMA, check_metadata=False)
        assert committed.to_pylist()[0]["output_tokens"] == a["output_tokens"] > 0
    # Running a committed shard again returns its committed accounting and writes nothing.
    assert run_shard(engine, shards[0], column, out, cfg)["wall_s"] == accts[0]["wall_s"]
    assert len(ofs.ls(f"{root}/accounting")) == 2


class _FlakyFS(MemoryFileSystem):
    """An in-memory store whose first `failures` writes fail with `error` (as s3fs raises a 503 SlowDown)."""

    def __init__(self, failures: int, error: OSError) -> None:
        super().__init__(skip_instance_cache=True)
        self.failures, self.error, self.calls = failures, error, 0

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: object) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        super().pipe_file(path, value, mode=mode, **kwargs)


def test_transient_errors_are_retried_and_final_ones_are_not(monkeypatch: pytest.MonkeyPatch,
                                                             data_dir: Path) -> None:
    monkeypatch.setattr(commit_table.retry, "sleep", lambda _s: None)
    table = _table(data_dir, 2)
    slow_down = _FlakyFS(2, OSError(errno.EBUSY, "SlowDown: please reduce your request rate"))
    assert commit_table(slow_down, "/out/results/a.parquet", table) is True and slow_down.calls == 3
    denied = _FlakyFS(1, PermissionError("AccessDenied"))
    with pytest.raises(PermissionError):
        commit_table(denied, "/out/results/a.parquet", table)
    assert denied.calls == 1
    down = _FlakyFS(99, OSError(errno.EREMOTEIO, "InternalError"))
    with pytest.raises(OSError, match="InternalError"):
        commit_table(down, "/out/results/a.parquet", table)
    assert down.calls == 5
    assert is_transient(TimeoutError()) and is_transient(ConnectionResetError())
    assert not is_transient(FileExistsError()) and not is_transient(FileNotFoundError())


def test_results_committed_without_accounting_are_billed_as_committed(engine: LLMEngine, tmp_path: Path,
                                                                      data_dir: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(_table(data_dir, 3), path)
    fs, files = resolve_inputs(str(path))
    cfg = RunConfig(prompt_column="question", max_tokens=3)
    (shard,) = plan_shards(fs, files, cfg)
    out = str(tmp_path / "out")
    first = run_shard(engine, shard, "question", out, cfg)
    results_file = Path(results_path(out, shard.shard_id))
    before = (results_file.stat().st_mtime_ns, pq.read_table(results_file))
    # A crash between the two commits: the results are there, the accounting is not.
    Path(accounting_path(out, shard.shard_id, 1)).unlink()
    counting = CountingEngine(engine)
    again = run_shard(counting, shard, "question", out, RunConfig(prompt_column="question", max_tokens=5))
    assert (results_file.stat().st_mtime_ns, pq.read_table(results_file)) == before  # never overwritten
    assert counting.prompts == 0  # every row is committed: nothing runs again, the results are only billed
    assert (again["attempt"], again["attempts"], again["rows"], again["rows_resumed"]) == (2, 2, 3, 3)
    assert again["output_tokens"] == first["output_tokens"] == 9  # what is committed, not what attempt 2 made
    # Attempt 1 died after its results (no end record): billed up to its last commit, as a preemption.
    assert again["preemptions"] == 1 and again["device_s_billed"] >= again["device_s"] + first["wall_s"]


def test_checkpointed_shard_resumes_on_s3(waves: LLMEngine, shard: Shard, reference: pa.Table,
                                          s3_bucket: str) -> None:
    out = f"s3://{s3_bucket}/checkpointed"
    committed = interrupt_after(waves, shard, out, shard_cfg(checkpoint_rows=4), 5).rows_committed
    fs, root = output_fs(out)
    parts = committed_parts(fs, root, shard.shard_id)  # parts and markers listed through s3fs
    assert len(parts) >= 2 and sum(p.rows for p in parts) == committed
    assert shard_state(out, shard.shard_id).state == "partial"
    counting = CountingEngine(waves)
    acct = run_shard(counting, shard, "question", out, shard_cfg(checkpoint_rows=4))
    assert counting.prompts == ROWS - committed and acct["rows_resumed"] == committed
    assert read_table(fs, results_path(root, shard.shard_id)).to_pylist() == reference.to_pylist()
    state = shard_state(out, shard.shard_id)
    assert (state.state, state.rows_committed, state.attempts) == ("done", ROWS, 2)


def test_reading_a_job_creates_no_folder(tmp_path: Path) -> None:
    """Readers open OUTPUT with read_fs, which creates nothing (output_fs, for writers, makes the folder): `tokenmill
    status` of a mistyped path must not leave an empty folder behind."""
    from pipeline.manifest import read_manifest
    from pipeline.model_pin import read_model_pin
    from pipeline.storage import read_fs

    out = tmp_path / "no" / "such" / "job"
    fs, root = read_fs(str(out) + "/")
    assert root == str(out) and not fs.exists(root)
    assert read_manifest(str(out)) is None and read_model_pin(str(out)) is None
    assert not (tmp_path / "no").exists()


class _ThreadSpyFile(io.RawIOBase):
    """A Parquet file's bytes as a Python file object that records which threads read it."""

    def __init__(self, data: bytes) -> None:
        self._f, self.threads = io.BytesIO(data), set()

    def _seen(self) -> None:
        self.threads.add(threading.current_thread().name)

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        self._seen()
        return self._f.readinto(b)

    def seek(self, *args: int) -> int:
        self._seen()
        return self._f.seek(*args)

    def tell(self) -> int:
        self._seen()
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def test_parquet_objects_and_input_row_groups_are_read_on_the_calling_thread_only(
        data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow's defaults read a Python file from Arrow's IO threads (here: up to 7 of them), one of which may drop
    the file's last buffer after the read returned; at the process's exit that thread is ended inside C++ (a core
    dump of a `tokenmill run` aborted after its summary: std::terminate). Committed objects (read_table) and a
    shard's input row groups (read_shard) are read on the caller's thread alone."""
    import pipeline.shard_rows as shard_rows

    buf = io.BytesIO()
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]), buf,
                   row_group_size=100)
    files: list[_ThreadSpyFile] = []

    def spy(*_args: object, **_kwargs: object) -> _ThreadSpyFile:
        files.append(_ThreadSpyFile(buf.getvalue()))
        return files[-1]

    class SpyFs:
        open = staticmethod(spy)

    for _ in range(10):  # the IO threads' share varies from read to read: several reads, each must stay on this one
        assert read_table(SpyFs(), "results.parquet", columns=["question"]).num_rows == 1319
        assert read_table(SpyFs(), "results.parquet").num_columns == 2
    monkeypatch.setattr(shard_rows, "open_pinned", spy)
    shard = Shard("0-250", "in.parquet", "file:///in.parquet", 250, 750)
    rows = shard_rows.read_shard(shard, "question", "id")
    assert len(rows.prompts) == 500
    assert {name for f in files for name in f.threads} == {threading.current_thread().name}
