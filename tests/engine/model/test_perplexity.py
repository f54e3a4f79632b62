"""Perplexity: the core function's contract and the `tokenmill perplexity` / `quantize` commands."""

from __future__ import annotations

import json
import math

import pytest
import typer
from typer.testing import CliRunner

from jobs.cli.model_commands import register


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def _perplexity_args(data_dir) -> list[str]:
    """`tokenmill perplexity` of the default model on 300 tokens of the first 5 AlpacaEval reference answers."""
    return ["perplexity", "--input", str(data_dir / "alpaca_eval.parquet"), "--column", "reference_output",
            "--limit", "5", "--max-tokens", "300", "--json", "--device", "cpu"]


@pytest.fixture(scope="module")
def gguf_perplexity(app: typer.Typer, data_dir) -> dict:
    """The JSON line of `_perplexity_args` on the default GGUF, run once per module (seconds of CPU)."""
    r = CliRunner().invoke(app, _perplexity_args(data_dir))
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def test_perplexity_json_line(gguf_perplexity: dict) -> None:
    line = gguf_perplexity
    assert set(line) == {"perplexity", "tokens"} and line["tokens"] == 299
    assert 1.0 < line["perplexity"] < 50.0 and math.isfinite(line["perplexity"])


def test_bad_column_and_bits_exit_2(app: typer.Typer, data_dir, tmp_path) -> None:
    r = CliRunner().invoke(app, ["perplexity", "--input", str(data_dir / "alpaca_eval.parquet"), "--column", "nope"])
    assert r.exit_code == 2 and "no column 'nope'" in r.output
    r = CliRunner().invoke(app, ["quantize", "--output", str(tmp_path / "x"), "--bits", "8"])
    assert r.exit_code == 2 and "bits must be 4" in r.output


def test_perplexity_rejects_short_input() -> None:
    import torch

    from engine.loading.presets import preset_config, random_model
    from engine.model.perplexity import perplexity

    model = random_model(preset_config("tiny"), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, [5])
    with pytest.raises(ValueError, match="context must be"):
        perplexity(model, [5, 6, 7], context=1)
    assert perplexity(model, list(range(100, 140)), context=16).tokens == 39 - 2  # 3 chunks: 15 + 15 + 7


def test_quantize_writes_a_folder_perplexity_loads(app: typer.Typer, data_dir, gguf_perplexity: dict,
                                                   tmp_path) -> None:
    """`tokenmill quantize` (round-to-nearest g32, embedding kept) prints its JSON line and writes a folder that
    `tokenmill perplexity --model DIR` scores close to the GGUF it came from (g32 projections: -0.04% on 20k
    tokens, bench/README.md)."""
    out = tmp_path / "int4"
    r = CliRunner().invoke(app, ["quantize", "--output", str(out), "--group-size", "32", "--keep-embedding"])
    assert r.exit_code == 0, r.output
    line = json.loads(r.output.strip().splitlines()[-1])
    assert line["bits"] == 4 and line["group_size"] == 32 and line["method"] == "rtn" and line["bytes"] > 0
    r = CliRunner().invoke(app, _perplexity_args(data_dir) + ["--model", str(out)])
    assert r.exit_code == 0, r.output
    scores = [gguf_perplexity["perplexity"], json.loads(r.output.strip().splitlines()[-1])["perplexity"]]
    assert abs(scores[1] / scores[0] - 1) < 0.02, scores
