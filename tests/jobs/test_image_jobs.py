"""`tokenmill run --image-column` end to end on the tiny LLaVA-1.5 (tests/image_rows.py) with a real Dask
LocalCluster: a Parquet in Hugging Face datasets' Image layout and an OpenAI batch file with image_url data: URLs;
completions equal LLMEngine.generate's on the same images, the summary counts images, the exported lines validate
as the `openai` package's types. Refused before any work (exit 2, one line): a text-only model given an image column,
an image column missing from the input, --max-pixels below LLaVA's one image size and --min-pixels above it.

The runs check what a job writes, not its own cluster: they run on the session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py), and the reference engine is loaded once for the module."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from image_rows import data_url, hf_image_table, llava_folder, pictures
from typer.testing import CliRunner

from engine import EngineConfig, LLMEngine, SamplingParams
from jobs.cli import app

runner = CliRunner()
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory, gguf_path: str) -> str:
    """The tiny LLaVA folder."""
    return llava_folder(tmp_path_factory.mktemp("tiny-llava"), gguf_path)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory, gsm8k_questions: list[str]) -> Path:
    """Four real GSM8K questions with pictures in datasets' Image layout (one a non-image: an error row)."""
    pics = pictures()
    cells = [{"bytes": pics[0], "path": "a.png"}, {"bytes": pics[3], "path": "b.jpg"},
             {"bytes": b"GIF89a but not really", "path": "c.gif"}, {"bytes": pics[5], "path": "d.jpg"}]
    path = tmp_path_factory.mktemp("in") / "in.parquet"
    pq.write_table(hf_image_table({"id": [f"q{i}" for i in range(4)], "question": gsm8k_questions[:4],
                                   "image": cells}, "image"), path)
    return path


@pytest.fixture(scope="module")
def llava_engine(llava: str) -> LLMEngine:
    """The reference: the tiny LLaVA on CPU in fp32, as the jobs run it."""
    return LLMEngine.from_model(llava, EngineConfig(device="cpu", dtype="float32"))


def _args(inp: Path, out: Path, model: str, *more: str) -> list[str]:
    return ["run", str(inp), str(out), "--model", model, "--max-tokens", str(MAX_TOKENS), "--dtype", "float32",
            "--workers", "1", "--json", *more]


def _expected(engine: LLMEngine, prompts: list[object]) -> list[str]:
    return [o.text for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]


def test_image_column_job_end_to_end(rows: Path, tmp_path: Path, llava: str, llava_engine: LLMEngine,
                                     shared_cluster: str) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, _args(rows, out, llava, "--prompt-column", "question", "--image-column", "image",
                                   "--max-images-per-row", "1", "--scheduler", shared_cluster))
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["rows_ok"], summary["rows_error"], summary["images"]) == (3, 1, 3)
    results = pq.read_table(out / "results").to_pylist()
    table = pq.read_table(rows).to_pylist()
    ok = [0, 1, 3]
    want = _expected(llava_engine,
                     [{"prompt": table[k]["question"], "images": [table[k]["image"]["bytes"]]} for k in ok])
    assert [results[k]["completion"] for k in ok] == want
    assert "not an image" in results[2]["error"] and results[2]["images"] == 1
    # image tokens are input tokens: 16 per image in every ran row's prompt_tokens
    assert summary["input_tokens"] == sum(results[k]["prompt_tokens"] for k in ok) > 3 * 16


def test_openai_batch_with_image_url_parts_runs_and_exports_valid_lines(tmp_path: Path, llava: str,
                                                                        llava_engine: LLMEngine,
                                                                        gsm8k_questions: list[str],
                                                                        shared_cluster: str) -> None:
    pics = pictures()
    lines = []
    for i in range(3):
        content = [{"type": "text", "text": gsm8k_questions[i]},
                   {"type": "image_url", "image_url": {"url": data_url(pics[i]), "detail": "low"}}]
        if i == 2:
            content[1]["image_url"]["url"] = str(tmp_path / "missing.png")
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "llava", "messages": [{"role": "user", "content": content}]}}))
    batch = tmp_path / "requests.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    res = runner.invoke(app, _args(batch, out, llava, "--scheduler", shared_cluster))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["images"] == 2
    exported = runner.invoke(app, ["export", str(out), "--format", "openai-batch"])
    assert exported.exit_code == 0, exported.output
    got = [json.loads(line) for line in exported.stdout.splitlines()]
    assert [g["custom_id"] for g in got] == ["r0", "r1", "r2"]
    msgs = [[{"role": "user", "content": [{"type": "text", "text": gsm8k_questions[i]},
                                          {"type": "image", "image": pics[i]}]}] for i in range(2)]
    from openai.types import BatchError  # 0.6 s: not at collection
    from openai.types.chat import ChatCompletion

    want = _expected(llava_engine, msgs)
    for g, text in zip(got[:2], want, strict=True):
        assert ChatCompletion.model_validate(g["response"]["body"]).choices[0].message.content == text
    error = BatchError.model_validate(got[2]["error"])
    assert "cannot read image" in error.message and "missing.png" in error.message


@pytest.mark.parametrize("case", ["text_only_model", "missing_column", "max_pixels", "min_pixels"])
def test_image_jobs_refused_before_any_work(case: str, rows: Path, tmp_path: Path, llava: str,
                                            tiny_model: str) -> None:
    out = tmp_path / "out"
    model, more, said = {
        "text_only_model": (tiny_model, ["--image-column", "image"], "is text-only"),
        "missing_column": (llava, ["--image-column", "picture"], "image column 'picture' not found"),
        "max_pixels": (llava, ["--image-column", "image", "--max-pixels", "3000"],
                       "--max-pixels 3000 is below the one size CLIPImageProcessor makes every image, 56x56 = 3136 "
                       "pixels (the model takes no smaller); give at least 3136, or drop --max-pixels"),
        "min_pixels": (llava, ["--image-column", "image", "--min-pixels", "4000"], "--min-pixels 4000 is above"),
    }[case]
    res = runner.invoke(app, _args(rows, out, model, "--prompt-column", "question", *more))
    assert res.exit_code == 2, res.output
    assert said in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (out / "results").exists()


def test_an_image_column_that_holds_numbers_is_refused(tmp_path: Path, llava: str) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"question": ["what is this?"], "image": [7]}), path)
    res = runner.invoke(app, _args(path, tmp_path / "out", llava, "--prompt-column", "question", "--image-column",
                                   "image"))
    assert res.exit_code == 2 and "holds int64, not images" in res.stderr, res.output
