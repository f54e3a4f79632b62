"""Image jobs on the tiny Qwen2.5-VL (dynamic resolution: each picture's size gives its own image tokens; tests/
image_rows.py): `tokenmill run --max-pixels` end to end on a small shard with a real Dask LocalCluster (fewer image
tokens, completions LLMEngine.generate's with the same limit), its `--dry-run` forecasting exactly the input tokens
and images the run's accounting then bills, a row whose text and image tokens exceed --max-model-len flagged by the
dry run, and limits the processor cannot honour refused before any work (exit 2, one line).

The run checks what a job writes, not its own cluster: it runs on the session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from image_rows import encoded, hf_image_table, picture, qwen_vl_folder
from typer.testing import CliRunner

from engine import EngineConfig, LLMEngine, SamplingParams
from jobs.cli import app

runner = CliRunner()
MAX_TOKENS = 4
LOWER = 40 * 40  # under a fifth of the tiny model's own max_pixels (96 x 96)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory, gguf_path: str) -> str:
    return qwen_vl_folder(tmp_path_factory.mktemp("tiny-qwen2_5_vl"), gguf_path)


@pytest.fixture(scope="module")
def full(qwen: str) -> LLMEngine:
    """tokenmill's engine over the tiny Qwen2.5-VL with its processor's own pixel limits (CPU, fp32)."""
    return LLMEngine.from_model(qwen, EngineConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory, gsm8k_questions: list[str]) -> Path:
    """Four real GSM8K questions with pictures of several sizes in datasets' Image layout; the last row two large
    ones (the longest row)."""
    pics = [encoded(picture(mode, size, seed), fmt) for seed, (mode, size, fmt) in enumerate(
        [("RGB", (80, 60), "PNG"), ("L", (40, 90), "JPEG"), ("RGBA", (64, 64), "PNG"), ("RGB", (120, 100), "JPEG"),
         ("RGB", (96, 130), "PNG")])]
    cells = [[{"bytes": p, "path": f"{k}.img"}] for k, p in enumerate(pics[:3])]
    cells.append([{"bytes": pics[3], "path": "3.jpg"}, {"bytes": pics[4], "path": "4.png"}])
    path = tmp_path_factory.mktemp("in") / "in.parquet"
    pq.write_table(hf_image_table({"id": [f"q{i}" for i in range(4)], "question": gsm8k_questions[10:14],
                                   "image": cells}, "image"), path)
    return path


def _args(inp: Path, out: Path, model: str, *more: str) -> list[str]:
    return ["run", str(inp), str(out), "--model", model, "--max-tokens", str(MAX_TOKENS), "--dtype", "float32",
            "--workers", "1", "--prompt-column", "question", "--image-column", "image", *more]


def _prompts(path: Path) -> list[dict]:
    table = pq.read_table(path).to_pylist()
    return [{"prompt": r["question"], "images": [c["bytes"] for c in r["image"]]} for r in table]


def test_max_pixels_runs_and_the_dry_run_forecasts_what_the_run_bills(rows: Path, tmp_path: Path, qwen: str,
                                                                       full: LLMEngine, shared_cluster: str) -> None:
    out = tmp_path / "out"
    dry = runner.invoke(app, _args(rows, out, qwen, "--max-pixels", str(LOWER), "--dry-run", "--json"))
    assert dry.exit_code == 0, dry.output
    fc = json.loads(dry.stdout.strip().splitlines()[-1])
    assert not out.exists()
    res = runner.invoke(app, _args(rows, out, qwen, "--max-pixels", str(LOWER), "--scheduler", shared_cluster,
                                   "--json"))
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["rows_ok"], summary["rows_error"], summary["images"]) == (4, 0, 5)
    # the one shard was read whole: its input tokens (text + image tokens) are exact, the accounting's
    assert fc["input_rows_sampled"] == fc["rows"] == 4 and fc["rows_too_long"] == 0
    assert (fc["input_tokens"], fc["images"]) == (summary["input_tokens"], summary["images"])
    assert 0 < fc["image_tokens"] < fc["input_tokens"] and fc["kv_rows_at_once"] >= 4
    # the limit went through the worker's engine: its completions, and fewer image tokens than without it
    prompts = _prompts(rows)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    limited = LLMEngine.from_model(qwen, EngineConfig(device="cpu", dtype="float32", max_image_pixels=LOWER))
    results = pq.read_table(out / "results").to_pylist()
    assert [r["completion"] for r in results] == [o.text for o in limited.generate(prompts, greedy)]
    assert all(r["prompt_tokens"] < len(full.prompt_token_ids(p)) for r, p in zip(results, prompts, strict=True))


def test_dry_run_flags_a_row_too_long_with_its_image_tokens(rows: Path, tmp_path: Path, qwen: str,
                                                            full: LLMEngine) -> None:
    sizes = [full.image_processor.prompt_size(p, full.tokenizer) for p in _prompts(rows)]
    longest = max(n for n, _ in sizes)
    limit = sorted(n for n, _ in sizes)[-2] + 1  # the others fit (a prompt needs one token fewer)
    res = runner.invoke(app, _args(rows, tmp_path / "out", qwen, "--max-model-len", str(limit), "--dry-run"))
    assert res.exit_code == 0, res.output
    words = " ".join(w for w in res.stdout.split() if w != "│")  # the table wraps its cells
    counts = sizes[[n for n, _ in sizes].index(longest)][1]
    assert (f"1 of the 4 rows read is longer than --max-model-len {limit} allows (the longest: {longest} tokens "
            f"= {longest - sum(counts)} text + {sum(counts)} image tokens of 2 images); they will be error rows: "
            "raise --max-model-len, or lower --max-pixels") in words, res.stdout
    ran = [c for n, c in sizes if n < limit]
    assert f"images / their tokens {sum(map(len, ran))} / {sum(map(sum, ran))} (in the input tokens" in words


@pytest.mark.parametrize(("more", "said"), [
    (["--max-pixels", "63"], "--max-pixels 63 is below the smallest image Qwen2VLImageProcessor makes, one merged "
                             "patch of 8x8 = 64 pixels; give at least 64"),
    (["--max-pixels", "2000", "--min-pixels", "3000"], "--max-pixels 2000 is below --min-pixels"),
])
def test_limits_the_processor_cannot_honour_are_refused(more: list[str], said: str, rows: Path, tmp_path: Path,
                                                        qwen: str) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, _args(rows, out, qwen, *more))
    assert res.exit_code == 2, res.output
    assert said in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()
