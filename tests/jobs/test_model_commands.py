"""`tokenmill quantize` as an Airflow task or a CI step sees it (output piped, not a terminal), on a tiny random
model folder with the real SmolLM2 tokenizer and real GSM8K calibration text: seconds, not the 11 minutes of the
full-size run (issue 16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from jobs.cli import app


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, gguf_path: str) -> Path:
    """A bf16 model folder of the "tiny" preset (2 layers, width 64, random weights, tied embedding) with the
    default model's tokenizer (same vocabulary size)."""
    from engine.loading.presets import preset_config, random_model
    from engine.loading.tokenmill_folder import save_folder
    from engine.text.tokenizer import Tokenizer

    cfg = preset_config("tiny")
    state = {k: v for k, v in random_model(cfg, torch.float32, torch.device("cpu")).state_dict().items()
             if k != "lm_head.weight"}
    path = tmp_path_factory.mktemp("tiny") / "model"
    save_folder(str(path), cfg, state, Tokenizer.from_model_path(gguf_path).hf_tokenizer, bits=16, group_size=None,
                source="tiny")
    return path


def _int4_modules(folder: Path) -> dict[str, int]:
    return json.loads((folder / "tokenmill_model.json").read_text())["quantization"]["modules"]


def test_quantize_piped_prints_json_progress_and_keeps_the_embedding(tiny_folder: Path, tmp_path: Path,
                                                                     data_dir: Path) -> None:
    """GPTQ with its output piped: JSON lines on stderr (start, each layer, tuning, done), the result on stdout;
    by default the tied embedding/LM head stays bf16 (INT4 g32 within 1% needs it: +3.7 to +4.8% with it INT4).
    Before: nothing on stderr until the end, and the embedding INT4.

    The command runs in this process with CliRunner's captured streams: stderr there is not a terminal, as a pipe
    is not (the choice is sys.stderr.isatty(), jobs.cli.model_commands); a child process would add only its start-up
    and torch import (about 4 CPU-s)."""
    out = tmp_path / "int4"
    res = CliRunner().invoke(app, [
        "quantize", "--model", str(tiny_folder), "--output", str(out), "--group-size", "32", "--method", "gptq",
        "--calibration", f"{data_dir / 'gsm8k_test.parquet'}#question", "--calibration-samples", "4",
        "--calibration-seq-len", "32"])
    assert res.exit_code == 0, res.output
    events = [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
    assert events[0] == {"event": "start", "method": "gptq", "bits": 4, "group_size": 32, "keep_embedding": True,
                         "elapsed_s": 0.0}
    layers = [e["done"] for e in events if e.get("stage") == "gptq layers"]
    assert layers == [1, 2]  # the tiny preset's two layers, one line each
    tune = [e for e in events if e.get("stage") == "tune steps"]
    assert tune and tune[-1]["done"] == tune[-1]["total"] and tune[-1]["kl"] >= 0
    assert events[-1]["event"] == "done"
    assert json.loads(res.stdout.strip().splitlines()[-1])["method"] == "gptq"
    modules = _int4_modules(out)
    assert "embed_tokens" not in modules and "layers.0.mlp.down_proj" in modules


def test_quantize_embedding_is_an_explicit_choice(tiny_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "int4-all"
    res = CliRunner().invoke(app, ["quantize", "--model", str(tiny_folder), "--output", str(out),
                                   "--group-size", "32", "--quantize-embedding"])
    assert res.exit_code == 0, res.output
    assert "embed_tokens" in _int4_modules(out)
    help_text = CliRunner().invoke(app, ["quantize", "--help"], env={"COLUMNS": "400"}).output
    assert "--quantize-embedding" in help_text and "+3.7" in help_text


def test_perplexity_takes_device_dtype_and_quantization_as_a_job_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """One definition (issue 31): `tokenmill perplexity` used to declare these again, quantization defaulting to
    `auto` where a job's is `none`; now its options are the job spec's, with their defaults and variables."""
    import typer.main

    from schemas.job_spec import OPTIONS

    group = typer.main.get_command(app)
    command = group.get_command(group.make_context("tokenmill", [], resilient_parsing=True), "perplexity")
    params = {p.name: p for p in command.params}
    for name in ("device", "dtype", "quantization"):
        assert params[name].default == OPTIONS[name].field.default, name
        assert params[name].envvar == OPTIONS[name].cli.envvar, name
    assert params["quantization"].default == "none"
    monkeypatch.setenv("TOKENMILL_QUANTIZATION", "int3")  # the engine's check, named as for a job
    r = CliRunner().invoke(app, ["perplexity", "--input", "x.parquet", "--column", "text"])
    assert r.exit_code == 2 and "quantization" in r.output and "int3" in r.output, r.output
