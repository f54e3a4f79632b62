"""A job whose `--model` is a Hugging Face hub id, end to end through the CLI (issue 51, item 1): downloaded from a
local server that answers as the hub does (tests/hub_server.py), then offline from tokenmill's model cache, offline
from HF's own cache only, as a `--dry-run`, and as a `submit` spec. Before, the client's fit check read the id as a
file path and the job died with exit 70 after the download."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_cli
import yaml
from hub_cache import write_hub_cache
from hub_server import HubServer, env_for
from typer.testing import CliRunner

from jobs.cli import app

runner = CliRunner()
gsm8k_folder = test_cli.gsm8k_folder  # the fixture: two Parquet files of real GSM8K rows (14 + 6)
REPO = "myorg/tiny-llama"


def _run(args: list[str]) -> dict:
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_job_runs_from_a_hub_id_online_offline_dry_run_and_submit(tiny_model: str, gsm8k_folder: Path,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    args = ["--prompt-column", "question", "--max-tokens", "4", "--device", "cpu", "--model", REPO, "--json"]
    with HubServer({REPO: tiny_model}) as hub:
        for k, v in env_for(hub).items():
            monkeypatch.setenv(k, v)
        forecast = _run(["run", str(gsm8k_folder), str(tmp_path / "dry"), *args, "--dry-run"])
        assert forecast["rows"] == 20 and not (tmp_path / "dry").exists()
        assert _run(["run", str(gsm8k_folder), str(tmp_path / "online"), *args])["rows_ok"] == 20
        assert set(hub.gets.values()) == {1}  # downloaded once, for the client and its worker
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the server gone: tokenmill's model cache serves it
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"input": str(gsm8k_folder), "output": str(tmp_path / "submitted"),
                                    "model": REPO, "columns": {"prompt": "question"},
                                    "sampling": {"max_tokens": 4}, "engine": {"device": "cpu"}}))
    assert _run(["submit", str(spec), "--json"])["rows_ok"] == 20
    shutil.rmtree(tmp_path / "cache")  # only in HF's own cache (what `hf download` fills), offline
    write_hub_cache(tmp_path / "hf", REPO, tiny_model)
    assert _run(["run", str(gsm8k_folder), str(tmp_path / "hf-cache"), *args])["rows_ok"] == 20
    assert _run(["run", str(gsm8k_folder), str(tmp_path / "dry2"), *args, "--dry-run"])["rows"] == 20
