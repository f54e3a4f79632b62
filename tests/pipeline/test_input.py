"""Input resolution, column validation and shard planning on real Parquet files (no model)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import InputError, RunConfig
from pipeline.input import plan_shards, resolve_inputs, validate_columns
from pipeline.manifest import changed_inputs, pin_manifest, read_manifest


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


def test_a_corrupt_file_is_logged_with_its_error_and_a_bug_is_not_taken_for_one(
        gsm8k_parts: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = gsm8k_parts / "part-1.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    fs, files = resolve_inputs(str(gsm8k_parts))
    with caplog.at_level(logging.WARNING, logger="pipeline.input"):
        validate_columns(fs, files, RunConfig())
        plan_shards(fs, files, RunConfig(rows_per_shard=100))
    skipped = [r.getMessage() for r in caplog.records if "part-1.parquet" in r.getMessage()]
    assert len(skipped) == 2 and all("ArrowInvalid" in m for m in skipped), skipped

    def broken(*args: object) -> None:  # a bug in our code, not a corrupt file
        raise TypeError("unexpected keyword")

    monkeypatch.setattr(pq, "read_schema", broken)
    with pytest.raises(TypeError, match="unexpected keyword"):
        validate_columns(fs, files, RunConfig())


# --- the pinned input manifest ---------------------------------------------------------------------------------------


def test_first_start_pins_the_manifest_and_later_runs_plan_from_it(gsm8k_parts: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    cfg = RunConfig(rows_per_shard=8, limit=40, max_tokens=16)
    manifest, created = pin_manifest(out, str(gsm8k_parts), cfg)
    assert created and (tmp_path / "out" / "_manifest" / "input.json").is_file()
    doc = json.loads((tmp_path / "out" / "_manifest" / "input.json").read_text())
    assert [Path(f["url"]).name for f in doc["files"]] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert [f["num_rows"] for f in doc["files"]] == [25, 10, 7]
    assert all(f["size"] == (gsm8k_parts / Path(f["url"]).name).stat().st_size for f in doc["files"])
    assert all(f["version"].startswith("mtime_ns:") for f in doc["files"])
    assert (doc["rows_per_shard"], doc["limit"], doc["prompt_column"]) == (8, 40, "prompt")
    fs, files = resolve_inputs(str(gsm8k_parts))
    assert manifest.shards() == plan_shards(fs, files, cfg)  # the same ids as a fresh plan
    assert sum(s.num_rows for s in manifest.shards()) == 40

    # A file added to the input folder later is not part of the job; shard ids stay put.
    pq.write_table(pq.read_table(gsm8k_parts / "part-2.parquet"), gsm8k_parts / "part-00.parquet")
    again, created = pin_manifest(out, f"{gsm8k_parts}/", cfg)  # the same folder, spelled differently
    assert not created and again == manifest
    assert read_manifest(out) == manifest and read_manifest(str(tmp_path / "nothing")) is None


@pytest.mark.parametrize(("change", "expected"), [
    ({"rows_per_shard": 4}, "rows_per_shard: the job has 8, this run asks for 4"),
    ({"limit": None}, "limit: the job has 40, this run asks for None"),
    ({"max_tokens": 32}, "max_tokens: the job has 16, this run asks for 32"),
    ({"allow_special_tokens": True}, "allow_special_tokens: the job has False, this run asks for True"),
    ({"choices": ("yes", "no")}, "choices: the job has None, this run asks for ['yes', 'no']"),
    ({"logprobs": 2}, "logprobs: the job has None, this run asks for 2"),
    ({"task": "embed", "embedding_dim": 128, "dimensions": 128}, "dimensions: the job has None, this run asks for 128"),
])
def test_other_shard_or_result_options_against_a_started_job_are_refused(gsm8k_parts: Path, tmp_path: Path,
                                                                          change: dict, expected: str) -> None:
    out = str(tmp_path / "out")
    base = {"rows_per_shard": 8, "limit": 40, "max_tokens": 16}
    pin_manifest(out, str(gsm8k_parts), RunConfig(**base))
    with pytest.raises(InputError) as e:
        pin_manifest(out, str(gsm8k_parts), RunConfig(**{**base, **change}))
    assert expected in str(e.value) and "new OUTPUT" in str(e.value)
    other = tmp_path / "other.parquet"
    pq.write_table(pq.read_table(gsm8k_parts / "part-1.parquet"), other)
    with pytest.raises(InputError, match="input: the job has"):
        pin_manifest(out, str(other), RunConfig(**base))


def test_a_job_pinned_before_the_structured_output_options_resumes_with_their_defaults(gsm8k_parts: Path,
                                                                                       tmp_path: Path) -> None:
    out = tmp_path / "out"
    manifest, _ = pin_manifest(str(out), str(gsm8k_parts), RunConfig(rows_per_shard=8))
    path = out / "_manifest" / "input.json"
    doc = json.loads(path.read_text())
    for name in ("n", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                 "json_schema", "json_object", "regex", "choices"):
        del doc["options"][name]
    path.write_text(json.dumps(doc))
    again, created = pin_manifest(str(out), str(gsm8k_parts), RunConfig(rows_per_shard=8))
    assert not created and again.shards() == manifest.shards()
    with pytest.raises(InputError, match="regex: the job has None"):
        pin_manifest(str(out), str(gsm8k_parts), RunConfig(rows_per_shard=8, regex="[0-9]+"))


def test_a_job_pinned_before_allow_special_tokens_resumes_only_as_it_ran(gsm8k_parts: Path, tmp_path: Path) -> None:
    """A manifest without allow_special_tokens comes from a version that parsed control-token text in prompts: it
    resumes with --allow-special-tokens, and the default (text) run is refused, not mixed into its results."""
    out = tmp_path / "out"
    manifest, _ = pin_manifest(str(out), str(gsm8k_parts), RunConfig(rows_per_shard=8))
    assert manifest.options["allow_special_tokens"] is False
    path = out / "_manifest" / "input.json"
    doc = json.loads(path.read_text())
    del doc["options"]["allow_special_tokens"]
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="allow_special_tokens: the job has True, this run asks for False"):
        pin_manifest(str(out), str(gsm8k_parts), RunConfig(rows_per_shard=8))
    again, created = pin_manifest(str(out), str(gsm8k_parts), RunConfig(rows_per_shard=8, allow_special_tokens=True))
    assert not created and again.shards() == manifest.shards()


def test_changed_or_vanished_input_files_are_reported(gsm8k_parts: Path, tmp_path: Path) -> None:
    manifest, _ = pin_manifest(str(tmp_path / "out"), str(gsm8k_parts), RunConfig(rows_per_shard=8))
    assert changed_inputs(manifest) == {}
    table = pq.read_table(gsm8k_parts / "part-1.parquet")
    pq.write_table(table.slice(0, 9), gsm8k_parts / "part-1.parquet")  # replaced: fewer rows
    (gsm8k_parts / "part-2.parquet").unlink()
    changed = changed_inputs(manifest)
    assert sorted(Path(u).name for u in changed) == ["part-1.parquet", "part-2.parquet"]
    one, two = (changed[f.url] for f in manifest.files[1:])
    assert "input changed since the job started" in one and "bytes, version mtime_ns:" in one
    assert "is gone" in two


def test_unreadable_file_is_pinned_without_rows(gsm8k_parts: Path, tmp_path: Path) -> None:
    (gsm8k_parts / "part-1.parquet").write_bytes(b"PAR1 this is not a parquet file")
    manifest, _ = pin_manifest(str(tmp_path / "out"), str(gsm8k_parts), RunConfig(rows_per_shard=100))
    assert [f.num_rows for f in manifest.files] == [25, None, 7]
    assert [(s.shard_id, s.row_end) for s in manifest.shards()] == [
        ("00000-000000000", 25), ("00001-000000000", -1), ("00002-000000000", 7)]


def test_manifest_on_a_flaky_s3_pins_etags(gsm8k_parts: Path) -> None:
    """Listing, footers and the commit all go through tenacity retries: a flaky store never makes a good file look
    corrupt or fails the pin."""
    import fsspec
    from s3_faults import flaky_s3

    with flaky_s3(rate=0.25, lost_rate=0.1, seed=3) as s3:
        fs = fsspec.filesystem("s3")
        s3.faults.enabled = False
        for p in sorted(gsm8k_parts.iterdir()):
            fs.put_file(str(p), f"{s3.bucket}/in/{p.name}")
        s3.faults.enabled = True
        cfg = RunConfig(rows_per_shard=10)
        manifest, created = pin_manifest(f"s3://{s3.bucket}/out", f"s3://{s3.bucket}/in/", cfg)
        assert created and [f.num_rows for f in manifest.files] == [25, 10, 7]
        assert all(f.version.startswith('"') for f in manifest.files)  # ETags
        assert pin_manifest(f"s3://{s3.bucket}/out", f"s3://{s3.bucket}/in", cfg) == (manifest, False)
        assert changed_inputs(manifest) == {}
        assert s3.faults.stats.faults > 0
