"""`--model` at an S3 URL and as a Hugging Face hub id through `tokenmill run`: the client checks the location
before any work (exit 2, one line, when it is missing), and on a real LocalCluster of two worker processes the model
is copied once per machine however many workers load it (engine.loading.model_files)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import test_cli
from hub_cache import write_hub_cache
from s3_faults import FlakyS3, GetCounter, flaky_s3, upload_folder
from typer.testing import CliRunner

from engine.loading.model_files import MODELS_DIR
from jobs.cli import app
from jobs.plan.preflight import check_model

runner = CliRunner()
gsm8k_folder = test_cli.gsm8k_folder  # the fixture: two Parquet files of real GSM8K rows (14 + 6)


@pytest.fixture(scope="module")
def s3() -> Iterator[FlakyS3]:
    """A moto S3 (no faults) whose GETs are counted (`s3.faults.delay`, a GetCounter)."""
    with flaky_s3(rate=0.0, lost_rate=0.0) as s3:
        s3.faults.delay = GetCounter()
        yield s3


def test_a_model_at_an_s3_url_runs_on_two_workers_copied_once(s3: FlakyS3, tiny_model: str, gsm8k_folder: Path,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))  # the worker processes inherit it: one machine, one cache
    url = upload_folder(s3.bucket, tiny_model, "models/tiny")
    counter: GetCounter = s3.faults.delay  # type: ignore[assignment]
    res = runner.invoke(app, ["run", str(gsm8k_folder), str(tmp_path / "out"), "--prompt-column", "question",
                              "--max-tokens", "4", "--workers", "2", "--model", url, "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["rows_ok"] == 20 and summary["shards"] == 2
    # Both workers loaded the engine (the plugin loads it on every worker); one copy was made, by one download.
    assert counter.gets[f"{s3.bucket}/models/tiny/model.safetensors"] == 1
    (copy,) = [p for p in (cache / MODELS_DIR).iterdir() if not p.name.endswith(".lock")]
    assert not copy.name.endswith(".partial") and sorted(p.name for p in (copy / "tiny").iterdir()) == sorted(
        p.name for p in Path(tiny_model).iterdir())


def _one_line_exit_2(args: list[str], out: Path) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and not out.exists()
    return res.stderr


def test_a_missing_url_or_hub_id_is_refused_before_the_job(s3: FlakyS3, gsm8k_folder: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    args = ["run", str(gsm8k_folder), str(out), "--prompt-column", "question", "--model"]
    counter: GetCounter = s3.faults.delay  # type: ignore[assignment]
    gets = sum(counter.gets.values())
    message = _one_line_exit_2([*args, f"s3://{s3.bucket}/models/nope/"], out)
    assert f"s3://{s3.bucket}/models/nope/ does not exist" in message
    fsspec.filesystem("s3").put_file(str(gsm8k_folder / "a.parquet"), f"{s3.bucket}/models/a.parquet")
    message = _one_line_exit_2([*args, f"s3://{s3.bucket}/models/a.parquet"], out)
    assert "is not a GGUF file" in message and "PAR1" in message
    assert sum(counter.gets.values()) == gets + 1  # the 4 bytes of the magic number, not the object
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # online, a hub id is downloaded (engine/loading/test_hub_download.py)
    monkeypatch.chdir(tmp_path)
    message = _one_line_exit_2([*args, "Qwen/Qwen2.5-7B-Instruct"], out)
    assert "'Qwen/Qwen2.5-7B-Instruct' is not a local path and not in the Hugging Face cache" in message
    assert str(tmp_path / "hf" / "hub") in message and "hf download Qwen/Qwen2.5-7B-Instruct" in message


def test_a_cached_hub_id_and_an_s3_folder_pass_the_check_as_given(s3: FlakyS3, tiny_model: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    write_hub_cache(tmp_path / "hf", "tokenmill/tiny-smollm2", tiny_model)
    monkeypatch.chdir(tmp_path)
    assert check_model("tokenmill/tiny-smollm2") == "tokenmill/tiny-smollm2"  # each worker resolves it itself
    url = upload_folder(s3.bucket, tiny_model, "models/checked")
    counter: GetCounter = s3.faults.delay  # type: ignore[assignment]
    assert check_model(url) == url
    assert counter.gets[f"{s3.bucket}/models/checked/model.safetensors"] == 0  # checked, not downloaded
