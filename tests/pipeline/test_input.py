"""Input resolution, column validation and shard planning on real Parquet files (no model)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import InputError, RunConfig
from pipeline.input import plan_shards, resolve_inputs, validate_columns


@pytest.fixture()
def gsm8k_parts(tmp_path: Path, data_dir: Path) -> Path:
    """Three Parquet files of real GSM8K rows (25, 10, 7 rows) in a folder, with small row groups."""
    table = pq.read_table(data_dir / "gsm8k_test.parquet").rename_columns(["id", "prompt", "answer"])
    folder = tmp_path / "in"
    folder.mkdir()
    offset = 0
    for i, n in enumerate([25, 10, 7]):
        pq.write_table(table.slice(offset, n), folder / f"part-{i}.parquet", row_group_size=4)
        offset += n
    return folder


def test_resolve_file_folder_glob_and_url(gsm8k_parts: Path) -> None:
    _, files = resolve_inputs(str(gsm8k_parts))
    assert [Path(f).name for f in files] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    _, globbed = resolve_inputs(str(gsm8k_parts / "part-[12].parquet"))
    assert [Path(f).name for f in globbed] == ["part-1.parquet", "part-2.parquet"]
    _, one = resolve_inputs(f"file://{gsm8k_parts / 'part-0.parquet'}")
    assert len(one) == 1
    with pytest.raises(InputError, match="does not exist"):
        resolve_inputs(str(gsm8k_parts / "nope.parquet"))
    empty = gsm8k_parts.parent / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no Parquet files"):
        resolve_inputs(str(empty))


def test_missing_prompt_column_names_it_and_the_columns_found(gsm8k_parts: Path) -> None:
    fs, files = resolve_inputs(str(gsm8k_parts))
    with pytest.raises(InputError) as e:
        validate_columns(fs, files, RunConfig(prompt_column="question"))
    msg = str(e.value)
    assert "'question'" in msg and "['id', 'prompt', 'answer']" in msg and "--prompt-column" in msg
    assert validate_columns(fs, files, RunConfig()) == "prompt"


def test_messages_column_is_used_when_prompt_column_is_absent(tmp_path: Path, data_dir: Path) -> None:
    qs = pq.read_table(data_dir / "gsm8k_test.parquet").column("question").to_pylist()[:3]
    msgs = [[{"role": "user", "content": q}] for q in qs]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    fs, files = resolve_inputs(str(tmp_path / "chat.parquet"))
    assert validate_columns(fs, files, RunConfig()) == "messages"


def test_plan_shards_is_deterministic_and_covers_every_row_once(gsm8k_parts: Path) -> None:
    fs, files = resolve_inputs(str(gsm8k_parts))
    shards = plan_shards(fs, files, RunConfig(rows_per_shard=8))
    assert [(s.shard_id, s.num_rows) for s in shards] == [
        ("00000-000000000", 8), ("00000-000000008", 8), ("00000-000000016", 8), ("00000-000000024", 1),
        ("00001-000000000", 8), ("00001-000000008", 2), ("00002-000000000", 7)]
    assert plan_shards(fs, files, RunConfig(rows_per_shard=8)) == shards
    limited = plan_shards(fs, files, RunConfig(rows_per_shard=8, limit=30))
    assert sum(s.num_rows for s in limited) == 30


def test_corrupt_file_is_planned_as_one_failing_shard(gsm8k_parts: Path) -> None:
    (gsm8k_parts / "part-1.parquet").write_bytes(b"PAR1 this is not a parquet file")
    fs, files = resolve_inputs(str(gsm8k_parts))
    assert validate_columns(fs, files, RunConfig()) == "prompt"  # the readable files decide
    shards = plan_shards(fs, files, RunConfig(rows_per_shard=100))
    assert [(s.shard_id, s.row_end) for s in shards] == [("00000-000000000", 25), ("00001-000000000", -1),
                                                          ("00002-000000000", 7)]
