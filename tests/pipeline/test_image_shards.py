"""Shards of image rows on the tiny LLaVA-1.5 (tests/image_rows.py): every image column form (bytes, Hugging Face
datasets' Image struct, local paths relative and absolute, s3:// URLs on the moto server, lists of them), chat messages
with image_url parts; each row's greedy completion is LLMEngine.generate's on the same images; bad images, too many
images and too many image tokens are error rows and the shard goes on; the accounting counts images; a shard stopped
mid-way resumes with only its uncommitted rows, each row once, the results equal to an undisturbed run's."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from image_rows import data_url, hf_image_table, llava_folder, pictures
from shard_helpers import CountingEngine, interrupt_after

from engine import EngineConfig, LLMEngine, SamplingParams
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.layout import results_path
from pipeline.shard import run_shard

MAX_TOKENS = 6
#: Context of the shards' engine: 1-2 images (16 tokens each) and a short question fit; 9 images do not.
MAX_MODEL_LEN = 144


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory, gguf_path: str) -> LLMEngine:
    """tokenmill's engine over the tiny LLaVA (CPU, fp32), 2 rows at a time (rows finish in waves), 144 tokens."""
    folder = llava_folder(tmp_path_factory.mktemp("tiny-llava"), gguf_path)
    return LLMEngine.from_model(folder, EngineConfig(device="cpu", dtype="float32", max_num_seqs=2,
                                                     max_model_len=MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def questions(gsm8k_questions: list[str]) -> list[str]:
    """Six short real GSM8K questions."""
    return sorted(gsm8k_questions, key=len)[:6]


def _cfg(**kw: object) -> RunConfig:
    return RunConfig(**{"prompt_column": "question", "image_column": "image", "max_tokens": MAX_TOKENS,
                        "checkpoint_seconds": 3600.0, **kw})


def _run(engine: LLMEngine, table: pa.Table, folder: Path, cfg: RunConfig, name: str = "in.parquet") -> pa.Table:
    """Write `table` to folder/name, run it as one shard into folder/out-<name's stem>, return its results (after
    checking that the accounting counts the images of the rows that ran)."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    pq.write_table(table, path)
    shard = Shard("00000-000000000", str(path), f"file://{path}", 0, table.num_rows)
    out = str(folder / f"out-{path.stem}")
    column = cfg.prompt_column if cfg.prompt_column in table.column_names else cfg.messages_column
    acct = run_shard(engine, shard, column, out, cfg)
    results = pq.read_table(results_path(out, shard.shard_id))
    assert acct["images"] == sum(n or 0 for n, e in zip(results["images"].to_pylist(), results["error"].to_pylist(),
                                                         strict=True) if e is None)
    return results


def _expected(engine: LLMEngine, prompts: list[object]) -> list[tuple[str, int]]:
    """(completion, prompt tokens) of LLMEngine.generate on `prompts` (greedy, MAX_TOKENS)."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.text, o.num_prompt_tokens) for o in outs]


def _got(results: pa.Table, rows: list[int]) -> list[tuple[str, int]]:
    r = results.to_pylist()
    return [(r[k]["completion"], r[k]["prompt_tokens"]) for k in rows]


def test_bytes_and_hf_image_structs_and_paths_run_as_the_engine_runs_them(
        llava: LLMEngine, questions: list[str], tmp_path: Path) -> None:
    """A binary column (a non-image and a null among them), then the same pictures in datasets' Image layout: bytes,
    a relative path, an absolute path, a missing file."""
    pics = pictures()
    q = questions
    results = _run(llava, pa.table({"question": q[:4], "image": pa.array([pics[0], pics[1], b"not an image", None],
                                                                          pa.binary())}), tmp_path, _cfg())
    assert results["images"].to_pylist() == [1, 1, 1, None]
    assert _got(results, [0, 1, 3]) == _expected(llava, [{"prompt": q[0], "images": [pics[0]]},
                                                         {"prompt": q[1], "images": [pics[1]]}, q[3]])
    bad = results.to_pylist()[2]
    assert bad["finish_reason"] == "error" and "not an image Pillow can read" in bad["error"]

    (tmp_path / "pics").mkdir()
    for i, p in enumerate(pics):
        (tmp_path / "pics" / f"{i}.img").write_bytes(p)
    cells = [{"bytes": pics[2], "path": "ignored.png"}, {"bytes": None, "path": "pics/3.img"},
             {"bytes": None, "path": str(tmp_path / "pics" / "4.img")}, {"bytes": None, "path": "pics/missing.png"}]
    hf = _run(llava, hf_image_table({"question": q[:4], "image": cells}, "image"), tmp_path, _cfg(), "hf.parquet")
    assert _got(hf, [0, 1, 2]) == _expected(llava, [{"prompt": q[k], "images": [pics[k + 2]]} for k in range(3)])
    error = hf["error"][3].as_py()
    assert "cannot read image" in error and "missing.png" in error and "FileNotFoundError" in error


def test_lists_of_paths_and_s3_urls_many_images_and_too_many_tokens(
        llava: LLMEngine, questions: list[str], tmp_path: Path, s3_bucket: str) -> None:
    """A list<string> column: two local images, an s3:// image on the moto server, one image on a missing key,
    three images against --max-images-per-row 2, nine images (9 x 16 tokens) past --max-model-len."""
    pics = pictures()
    fs = fsspec.filesystem("s3")
    fs.pipe(f"{s3_bucket}/imgs/cat.jpg", pics[5])
    for i, p in enumerate(pics):
        (tmp_path / f"{i}.png").write_bytes(p)
    q = questions
    cells = [["0.png", str(tmp_path / "1.png")], [f"s3://{s3_bucket}/imgs/cat.jpg"],
             [f"s3://{s3_bucket}/imgs/nope.jpg"], ["0.png", "1.png", "2.png"], ["4.png"] * 9]
    results = _run(llava, pa.table({"question": q[:5], "image": cells}), tmp_path, _cfg(max_images_per_row=9))
    assert _got(results, [0, 1]) == _expected(llava, [{"prompt": q[0], "images": pics[:2]},
                                                      {"prompt": q[1], "images": [pics[5]]}])
    errors = results["error"].to_pylist()
    assert "cannot read image" in errors[2] and "nope.jpg" in errors[2]
    assert "too long" in errors[4] or str(MAX_MODEL_LEN) in errors[4], errors[4]
    assert results["images"].to_pylist() == [2, 1, 1, 3, 9]

    capped = _run(llava, pa.table({"question": q[:5], "image": cells}), tmp_path, _cfg(max_images_per_row=2),
                  "capped.parquet")
    assert "3 images, more than --max-images-per-row 2" in capped["error"][3].as_py()
    assert capped["error"][0].as_py() is None


def test_messages_with_image_url_parts_data_and_s3(llava: LLMEngine, questions: list[str], tmp_path: Path,
                                                   s3_bucket: str) -> None:
    """A messages column (JSON text) whose parts hold a data: URL and an s3:// URL, and one whose bare image part
    takes the image column's picture; no --image-column for the first file."""
    pics = pictures()
    fsspec.filesystem("s3").pipe(f"{s3_bucket}/imgs/m.png", pics[3])

    def msg(q: str, *parts: dict) -> str:
        return json.dumps([{"role": "user", "content": [*parts, {"type": "text", "text": q}]}])

    q = questions
    rows = [msg(q[0], {"type": "image_url", "image_url": {"url": data_url(pics[0])}}),
            msg(q[1], {"type": "image_url", "image_url": {"url": f"s3://{s3_bucket}/imgs/m.png"}}),
            json.dumps([{"role": "user", "content": q[2]}])]
    results = _run(llava, pa.table({"messages": rows}), tmp_path,
                   RunConfig(max_tokens=MAX_TOKENS, checkpoint_seconds=3600.0))
    parts = [[{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": q[k]}]}]
             for k, img in ((0, pics[0]), (1, pics[3]))]
    assert _got(results, [0, 1, 2]) == _expected(llava, [parts[0], parts[1], q[2]])
    assert results["images"].to_pylist() == [1, 1, None]

    col = _run(llava, pa.table({"messages": [json.dumps([{"role": "user", "content": q[3]}])],
                                "image": pa.array([pics[4]], pa.binary())}), tmp_path / "col",
               RunConfig(image_column="image", max_tokens=MAX_TOKENS))
    assert _got(col, [0]) == _expected(llava, [{"prompt": q[3], "images": [pics[4]]}])


def test_an_image_shard_stopped_mid_way_resumes_each_row_once(llava: LLMEngine, questions: list[str],
                                                               tmp_path: Path) -> None:
    pics = pictures()
    rows = 6
    table = hf_image_table({"question": questions[:rows], "image": [{"bytes": p, "path": None} for p in pics]},
                           "image")
    path = tmp_path / "in.parquet"
    pq.write_table(table, path)
    shard = Shard("00000-000000000", str(path), f"file://{path}", 0, rows)
    reference = _run(llava, table, tmp_path / "ref", _cfg())
    out = str(tmp_path / "out")
    stopped = interrupt_after(llava, shard, out, _cfg(checkpoint_rows=2), 2)
    assert 2 <= stopped.rows_committed < rows
    counting = CountingEngine(llava)
    acct = run_shard(counting, shard, "question", out, _cfg())
    assert counting.prompts == rows - stopped.rows_committed  # only the uncommitted rows ran again
    results = pq.read_table(results_path(out, shard.shard_id))
    drop = ["input_file"]
    assert results.drop(drop).to_pylist() == reference.drop(drop).to_pylist()
    assert (acct["rows_resumed"], acct["preemptions"], acct["images"]) == (stopped.rows_committed, 1, rows)


def test_image_parts_on_a_text_only_model_are_error_rows(engine: LLMEngine, questions: list[str],
                                                          tmp_path: Path) -> None:
    """Messages with an image part on the tiny text-only model: that row is an error row, the text rows run."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(pictures()[0])}}, {"type": "text", "text": "hi"}]
    rows = [json.dumps([{"role": "user", "content": parts}]), json.dumps([{"role": "user", "content": questions[0]}])]
    results = _run(engine, pa.table({"messages": rows}), tmp_path, RunConfig(max_tokens=2)).to_pylist()
    assert "the model is text-only" in results[0]["error"] and results[1]["error"] is None
