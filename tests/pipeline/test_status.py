"""shard_state from the records under OUTPUT: failed (a corrupt input, other shards unaffected), done, running,
partial, stale, pending."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shard_helpers import shard_cfg

from engine import LLMEngine, RequestOutput
from pipeline.accounting import OLD_NAMES, EarlierAttempts, accounting_row, bill_earlier_attempts
from pipeline.attempts import claim_attempt, end_attempt, end_on_full_disk, list_attempts
from pipeline.checkpoint import Checkpointer
from pipeline.input import Shard
from pipeline.layout import accounting_path, alive_path, end_path, results_path
from pipeline.shard import ShardError, run_shard
from pipeline.status import shard_state
from pipeline.storage import commit_json, commit_table, output_fs
from schemas import ACCOUNTING_SCHEMA, RESULTS_SCHEMA


def test_corrupt_input_fails_its_shard_with_the_error_and_the_others_finish(engine: LLMEngine, rows_file: str,
                                                                            tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(b"PAR1 truncated by a failed upload")
    broken = Shard("00000-000000000", str(bad), f"file://{bad}", 0, -1)
    good = Shard("00001-000000000", rows_file, f"file://{rows_file}", 0, 3)
    with pytest.raises(ShardError):
        run_shard(engine, broken, "question", out, shard_cfg())
    acct = run_shard(engine, good, "question", out, shard_cfg(max_tokens=4))

    failed = shard_state(out, broken.shard_id)
    assert (failed.state, failed.attempts, failed.rows_committed, failed.accounting) == ("failed", 1, 0, None)
    assert "corrupt.parquet" in (failed.last_error or "") and failed.last_activity is not None
    done = shard_state(out, good.shard_id)
    assert (done.state, done.rows_committed, done.attempts, done.last_error) == ("done", 3, 1, None)
    assert done.accounting == acct
    assert shard_state(out, "00002-000000000").state == "pending"  # never started
    # A rerun of the failed shard (the file fixed or not) is a new attempt; its state follows the latest one.
    with pytest.raises(ShardError):
        run_shard(engine, broken, "question", out, shard_cfg())
    assert shard_state(out, broken.shard_id).attempts == 2


def test_running_partial_stale_and_pending_follow_the_records(rows_file: str, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    fs, root = output_fs(out)
    shard_id = "00000-000000000"
    table = pq.read_table(rows_file, columns=["id", "question"])
    assert shard_state(out, shard_id).state == "pending"

    attempt, _ = claim_attempt(fs, root, shard_id)
    started = shard_state(out, shard_id)
    assert (started.state, started.rows_committed, started.attempts) == ("running", 0, 1)
    ckpt = Checkpointer(fs, root, shard_id, attempt, "SmolLM2", every_rows=2, every_s=60.0, started=time.monotonic())
    for k, row_id in enumerate(table.column("id").to_pylist()[:5]):
        ckpt.add(k, RequestOutput(row_id, [1, 2, 3], [4, 5], "Natalia sold 48 clips", "length"))
    running = shard_state(out, shard_id)
    assert (running.state, running.rows_committed) == ("running", 4)  # 2 parts of 2; the 5th row is pending
    later = time.time() + 700  # no activity for longer than stale_after_s: the worker is gone
    assert shard_state(out, shard_id, now=later).state == "partial"
    assert shard_state(out, shard_id, stale_after_s=3600, now=later).state == "running"

    end_attempt(fs, root, shard_id, attempt, "interrupted", rows_committed=4, device_s=3.0, reason="SIGTERM")
    assert shard_state(out, shard_id).state == "partial"  # ended: not running, whatever the clock says
    claim_attempt(fs, root, "00001-000000000")
    assert shard_state(out, "00001-000000000", now=later).state == "pending"  # killed before any checkpoint


def test_accounting_written_before_the_dtype_columns_still_reads(tmp_path: Path) -> None:
    """A shard committed by a tokenmill whose ACCOUNTING_SCHEMA had no dtype / quantization columns is done, its
    accounting read with those two as null and every other column as written."""
    out = str(tmp_path / "out")
    fs, root = output_fs(out)
    shard_id = "00000-000000000"
    attempt, _ = claim_attempt(fs, root, shard_id)
    results = pa.Table.from_pylist([{"id": "0", "completion": "Natalia sold 48 clips", "finish_reason": "length",
                                     "prompt_tokens": 12, "completion_tokens": 5, "error": None, "model": "m",
                                     "input_file": "file:///in.parquet", "input_row": 0}],
                                   schema=RESULTS_SCHEMA)
    commit_table(fs, results_path(root, shard_id), results)
    row = accounting_row(shard_id=shard_id, attempt=attempt, input_path="file:///in.parquet", row_start=0,
                         results=results, wall_s=1.0, generated_tokens=5, device_s=1.5, earlier=EarlierAttempts(),
                         rows_resumed=0, kv_preemptions=0, device="cpu", dtype="float32", quantization="none",
                         model="m", price_per_hour_usd=2.0)
    old_schema = pa.schema([f for f in ACCOUNTING_SCHEMA if f.name not in ("dtype", "quantization")])
    commit_table(fs, accounting_path(root, shard_id, attempt), pa.Table.from_pylist([row], schema=old_schema))

    done = shard_state(out, shard_id)
    assert (done.state, done.rows_committed) == ("done", 1) and done.accounting is not None
    assert list(done.accounting) == ACCOUNTING_SCHEMA.names
    assert (done.accounting["dtype"], done.accounting["quantization"]) == (None, None)
    assert done.accounting["output_tokens"] == 5 and done.accounting["cost_usd"] == pytest.approx(1.5 / 3600 * 2.0)


def test_accounting_and_attempt_records_written_under_the_gpu_s_names_still_read(tmp_path: Path) -> None:
    """An OUTPUT written before gpu_s, gpu_s_lost and gpu_s_billed were renamed device_s, device_s_lost and
    device_s_billed (issue 31): its accounting reads under the new names with the values as written, and an
    earlier attempt's end record that says gpu_s is billed those device-seconds."""
    out = str(tmp_path / "out")
    fs, root = output_fs(out)
    shard_id = "00000-000000000"
    first, _ = claim_attempt(fs, root, shard_id)
    commit_json(fs, end_path(root, shard_id, first), {"attempt": first, "outcome": "interrupted",
                                                      "rows_committed": 0, "gpu_s": 2.5, "ended_at": time.time(),
                                                      "reason": "SIGTERM", "error": None})
    attempt, _ = claim_attempt(fs, root, shard_id)
    earlier = bill_earlier_attempts(fs, root, shard_id, attempt, list_attempts(fs, root, shard_id), [], 60.0)
    assert (earlier.preemptions, earlier.device_s, earlier.device_s_lost) == (1, 2.5, 2.5)

    results = pa.Table.from_pylist([{"id": "0", "completion": "Natalia sold 48 clips", "finish_reason": "length",
                                     "prompt_tokens": 12, "completion_tokens": 5, "error": None, "model": "m",
                                     "input_file": "file:///in.parquet", "input_row": 0}],
                                   schema=RESULTS_SCHEMA)
    commit_table(fs, results_path(root, shard_id), results)
    row = accounting_row(shard_id=shard_id, attempt=attempt, input_path="file:///in.parquet", row_start=0,
                         results=results, wall_s=1.0, generated_tokens=5, device_s=1.5, earlier=earlier,
                         rows_resumed=0, kv_preemptions=0, device="cpu", dtype="float32", quantization="none",
                         model="m", price_per_hour_usd=2.0)
    old = {new: name for name, new in OLD_NAMES.items()}
    old_schema = pa.schema([f.with_name(old.get(f.name, f.name)) for f in ACCOUNTING_SCHEMA])
    old_row = {old.get(k, k): v for k, v in row.items()}
    commit_table(fs, accounting_path(root, shard_id, attempt), pa.Table.from_pylist([old_row], schema=old_schema))
    assert "gpu_s_billed" in pq.read_schema(accounting_path(root, shard_id, attempt)).names

    done = shard_state(out, shard_id)
    assert done.state == "done" and done.accounting is not None
    assert list(done.accounting) == ACCOUNTING_SCHEMA.names  # no gpu_s* keys beside the new ones
    acc = done.accounting
    assert (acc["device_s"], acc["device_s_lost"], acc["device_s_billed"]) == (1.5, 2.5, 4.0)
    assert acc["cost_usd"] == pytest.approx(4.0 / 3600 * 2.0)


def test_killed_attempts_that_shared_an_engine_are_billed_their_shares_once(tmp_path: Path) -> None:
    """Four shards' attempts on one worker's engine, killed 40 s into it (SIGKILL: no end record): each is billed the
    device-seconds its last sign of life says it held (the heartbeat's name, the marker's device_s), so together the
    worker's 40 s, not 4 x 40 (issue 51 item 2). A heartbeat of an older version (no device-seconds in its name)
    still bills its start to that sign."""
    fs, root = output_fs(str(tmp_path / "out"))
    billed = []
    for k in range(4):
        shard_id = f"0000{k}-000000000"
        first, _ = claim_attempt(fs, root, shard_id, heartbeat_s=15.0)
        commit_json(fs, alive_path(root, shard_id, first, 40.0, device_s=10.0), {"attempt": first})
        attempt, _ = claim_attempt(fs, root, shard_id)
        earlier = bill_earlier_attempts(fs, root, shard_id, attempt, list_attempts(fs, root, shard_id), [], 60.0)
        assert earlier.preemptions == 1
        billed.append(earlier.device_s)
    assert sum(billed) == pytest.approx(40.0)

    shard_id = "00009-000000000"
    first, _ = claim_attempt(fs, root, shard_id, heartbeat_s=15.0)
    commit_json(fs, alive_path(root, shard_id, first, 40.0), {"attempt": first})
    attempt, _ = claim_attempt(fs, root, shard_id)
    earlier = bill_earlier_attempts(fs, root, shard_id, attempt, list_attempts(fs, root, shard_id), [], 60.0)
    assert earlier.device_s == pytest.approx(40.0)


def test_an_attempt_stopped_by_a_full_disk_is_billed_its_share_and_not_preempted(tmp_path: Path) -> None:
    """Its end record is an empty file whose name holds its device-seconds (a full device still takes a name): billed
    as is, device_s_lost after its last commit's device_s, no preemption; the shard is not shown running."""
    out = str(tmp_path / "out")
    fs, root = output_fs(out)
    shard_id = "00000-000000000"
    first, _ = claim_attempt(fs, root, shard_id, heartbeat_s=15.0)
    end_on_full_disk(fs, root, shard_id, first, 3.25)
    assert shard_state(out, shard_id).state == "pending"
    attempt, _ = claim_attempt(fs, root, shard_id)
    earlier = bill_earlier_attempts(fs, root, shard_id, attempt, list_attempts(fs, root, shard_id), [], 60.0)
    assert (earlier.preemptions, earlier.device_s, earlier.device_s_lost) == (0, 3.25, 3.25)
