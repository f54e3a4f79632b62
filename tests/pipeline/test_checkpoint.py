"""Checkpoint parts on the real engine: parts with markers, resume past a part without one, two racing attempts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shard_helpers import MAX_TOKENS, NULL_ROW, ROWS, CountingEngine, interrupt_after, shard_cfg

from engine import LLMEngine
from pipeline import checkpoint
from pipeline.attempts import claim_attempt
from pipeline.input import Shard
from pipeline.layout import part_stem, results_path
from pipeline.shard import run_shard
from pipeline.storage import commit_json, commit_table, output_fs
from schemas.arrow import CHECKPOINT_PART_SCHEMA


def _results(out: str, shard: Shard) -> pa.Table:
    return pq.read_table(results_path(out, shard.shard_id))


def _names(folder: Path, suffix: str) -> list[str]:
    return sorted(p.name.removesuffix(suffix) for p in folder.glob(f"*{suffix}"))


def test_parts_with_markers_give_the_results_of_an_undisturbed_run(waves: LLMEngine, shard: Shard,
                                                                   reference: pa.Table, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    acct = run_shard(waves, shard, "question", out, shard_cfg(checkpoint_rows=4))
    folder = tmp_path / "out" / "checkpoints" / shard.shard_id
    parts, markers = _names(folder, ".parquet"), _names(folder, ".commit")
    assert parts == markers == [f"a001-p{i:05d}-n4" for i in range(1, 5)]  # 16 rows, a part every 4
    rows = pa.concat_tables(pq.read_table(folder / f"{p}.parquet") for p in parts)
    assert sorted(rows.column("row").to_pylist()) == list(range(ROWS))
    bad = rows.filter(pa.compute.equal(rows.column("row"), NULL_ROW)).to_pylist()
    assert bad[0]["finish_reason"] == "error" and "null" in bad[0]["error"]  # bad rows are finished rows too

    results = _results(out, shard)
    assert results.to_pylist() == reference.to_pylist()  # greedy: the same text, token counts, errors
    assert results.column("id").to_pylist() == pq.read_table(shard.path).column("id").to_pylist()
    assert (acct["attempts"], acct["preemptions"], acct["rows_resumed"], acct["device_s_lost"]) == (1, 0, 0, 0.0)
    assert acct["output_tokens"] == (ROWS - 1) * MAX_TOKENS
    assert acct["cost_usd"] == pytest.approx(acct["device_s_billed"] / 3600 * acct["price_per_hour_usd"])


def test_a_part_without_its_marker_is_ignored_on_resume(waves: LLMEngine, shard: Shard, reference: pa.Table,
                                                        tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    # checkpoint_seconds tiny: every finished row is due for a commit, so each part holds one row.
    cfg = shard_cfg(checkpoint_rows=1000, checkpoint_seconds=1e-6)
    committed = interrupt_after(waves, shard, out, cfg, 5).rows_committed
    folder = tmp_path / "out" / "checkpoints" / shard.shard_id
    markers = _names(folder, ".commit")
    assert len(markers) == committed and all(m.endswith("-n1") for m in markers)
    (folder / f"{markers[-1]}.commit").unlink()  # a crash between the last part and its marker

    counting = CountingEngine(waves)
    acct = run_shard(counting, shard, "question", out, cfg)
    # The unmarked part's row runs again; the null row (committed in part 1) never reaches the engine.
    assert counting.prompts == ROWS - committed + 1
    assert acct["rows_resumed"] == committed - 1 and acct["attempts"] == 2
    assert _results(out, shard).to_pylist() == reference.to_pylist()


class _ZombieEngine(CountingEngine):
    """While this attempt generates, an older attempt of the same shard (a zombie worker) commits a part holding
    some of the same rows."""

    def __init__(self, engine: LLMEngine, commit_zombie_part: Any) -> None:
        super().__init__(engine)
        self.commit_zombie_part = commit_zombie_part

    def generate(self, prompts: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.commit_zombie_part()
        return super().generate(prompts, *args, **kwargs)


def test_rows_committed_by_two_racing_attempts_appear_once(waves: LLMEngine, shard: Shard, reference: pa.Table,
                                                           tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    fs, root = output_fs(out)
    zombie, _ = claim_attempt(fs, root, shard.shard_id)
    assert zombie == 1

    def commit_zombie_part() -> None:
        rows = reference.slice(8, 4).drop_columns(["input_file", "input_row"])
        part = rows.append_column("row", pa.array(range(8, 12), pa.int64())).append_column(
            "kv_preemptions", pa.array([0] * 4, pa.int32())).append_column(
            "latency_s", pa.array([1.0] * 4, pa.float64())).cast(CHECKPOINT_PART_SCHEMA)
        stem = part_stem(root, shard.shard_id, zombie, 1, 4)
        assert commit_table(fs, f"{stem}.parquet", part)
        assert commit_json(fs, f"{stem}.commit", {"attempt": zombie, "part": 1, "rows": 4, "elapsed_s": 1.0,
                                                  "committed_at": time.time()})

    engine = _ZombieEngine(waves, commit_zombie_part)
    acct = run_shard(engine, shard, "question", out, shard_cfg(checkpoint_rows=8))
    assert engine.prompts == ROWS - 1  # attempt 2 listed no parts when it started: it ran every row
    folder = tmp_path / "out" / "checkpoints" / shard.shard_id
    assert "a001-p00001-n4" in _names(folder, ".commit") and len(_names(folder, ".commit")) == 3
    results = _results(out, shard)
    assert results.column("id").to_pylist() == reference.column("id").to_pylist()  # rows 8..11 once each
    assert results.to_pylist() == reference.to_pylist()
    # The zombie never ended: billed as a killed attempt (a preemption), from its marker's elapsed time on.
    assert (acct["attempts"], acct["preemptions"], acct["rows_resumed"]) == (2, 1, 0)
    assert acct["device_s_billed"] >= acct["device_s"] + 1.0


def test_a_failed_part_commit_fails_the_attempt_and_leaves_the_engine_clean(
        waves: LLMEngine, shard: Shard, reference: pa.Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = str(tmp_path / "out")
    real_commit, calls = checkpoint.commit_table, [0]

    def denied_after_one_part(*args: Any, **kwargs: Any) -> bool:
        calls[0] += 1
        if calls[0] > 1:
            raise PermissionError("AccessDenied: the role lost s3:PutObject")
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "commit_table", denied_after_one_part)
    with pytest.raises(PermissionError, match="AccessDenied"):
        run_shard(waves, shard, "question", out, shard_cfg(checkpoint_rows=4))
    assert not waves.scheduler.has_unfinished  # the resident engine stopped cleanly: the next shard can run
    end = json.loads((tmp_path / "out" / "attempts" / shard.shard_id / "attempt-001.end.json").read_text())
    assert end["outcome"] == "failed" and "AccessDenied" in end["error"]

    monkeypatch.setattr(checkpoint, "commit_table", real_commit)
    counting = CountingEngine(waves)
    acct = run_shard(counting, shard, "question", out, shard_cfg(checkpoint_rows=4))
    assert counting.prompts == ROWS - 4 and acct["rows_resumed"] == 4  # part 1 (the null row and 3 more) kept
    assert _results(out, shard).to_pylist() == reference.to_pylist()
