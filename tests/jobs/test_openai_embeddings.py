"""OpenAI batch `/v1/embeddings` in (`tokenmill run requests.jsonl OUTPUT`: an embed job) and out (`tokenmill export`):
real GSM8K questions and AlpacaEval instructions, the real default embedding model, a real Dask LocalCluster; the
exported lines validated with the `openai` package's own types.

The run checks what a job writes, not its own cluster: it runs on the session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from engine import EngineConfig, LLMEngine
from jobs.cli import app
from jobs.errors import JobError
from jobs.formats.openai_batch import CHAT_URL, parse_batch_lines
from jobs.formats.openai_embeddings import EMBEDDINGS_URL, file_dimensions, job_dimensions

runner = CliRunner()


def _line(custom_id: str, body: dict, url: str = EMBEDDINGS_URL) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def minilm(minilm_folder: str) -> LLMEngine:
    """The default embedding model in float32 (the reference vectors)."""
    return LLMEngine.from_model(minilm_folder, EngineConfig(device="cpu", dtype="float32"))


def test_embedding_requests_become_rows_and_bad_lines_error_rows(gsm8k_questions: list[str]) -> None:
    q = gsm8k_questions[:3]
    lines = [
        _line("one", {"model": "text-embedding-3-small", "input": q[0], "dimensions": 64}),
        _line("list", {"input": q[1:3], "encoding_format": "base64", "dimensions": 64}),
        _line("ids", {"input": [101, 2023], "dimensions": 64}),
        _line("fmt", {"input": q[0], "encoding_format": "int8"}),
        _line("extra", {"input": q[0], "stream": True}),
        _line("none", {"input": []}),
        _line("chat", {"messages": [{"role": "user", "content": q[0]}]}, CHAT_URL),
    ]
    table, endpoint = parse_batch_lines(lines)
    assert endpoint == EMBEDDINGS_URL
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["one", "list[0]", "list[1]", "ids", "fmt", "extra", "none", "chat"]
    assert [r["custom_id"] for r in rows[1:3]] == ["list", "list"]
    assert [(r["prompt"], r["input_index"], r["input_count"]) for r in rows[:3]] == [(q[0], 0, 1), (q[1], 0, 2),
                                                                                     (q[2], 1, 2)]
    assert (rows[0]["request_model"], rows[0]["encoding_format"], rows[1]["encoding_format"]) == (
        "text-embedding-3-small", "float", "base64")
    errors = {r["id"]: r["request_error"] for r in rows[3:]}
    assert "line 3: body.input[0] is int, not text; token-id inputs are not supported" in errors["ids"]
    assert "body.encoding_format must be float or base64, got 'int8'" in errors["fmt"]
    assert "body fields ['stream'] are not supported for /v1/embeddings" in errors["extra"]
    assert "body.input must be a text or a non-empty list of texts" in errors["none"]
    assert "differs from this file's endpoint '/v1/embeddings'" in errors["chat"]
    assert file_dimensions(table, "r.jsonl") == 64  # error lines ask for nothing

    mixed, _ = parse_batch_lines([lines[0], _line("wide", {"input": q[1], "dimensions": 128}),
                                  _line("whole", {"input": q[2]})])
    with pytest.raises(JobError, match=r"asks for different body.dimensions: 64 \(custom_id 'one'\); 128 "
                                       r"\(custom_id 'wide'\); none \(custom_id 'whole'\); .* split the file"):
        file_dimensions(mixed, "r.jsonl")
    assert job_dimensions(None, 64) == job_dimensions(64, None) == job_dimensions(64, 64) == 64
    with pytest.raises(JobError, match="--dimensions 32 differs from the body.dimensions 64"):
        job_dimensions(32, 64)


def _cosines(got: list[list[float]], want: list[np.ndarray]) -> np.ndarray:
    return (np.array(got, dtype=np.float32) * np.stack(want)).sum(1)  # unit vectors


@pytest.mark.slow  # the real model on a real LocalCluster (tests/jobs/conftest.py)
def test_embeddings_batch_runs_and_exports_what_openai_types_accept(
        tmp_path: Path, minilm_folder: str, minilm: LLMEngine, gsm8k_questions: list[str],
        alpaca_instructions: list[str], shared_cluster: str) -> None:
    texts = gsm8k_questions[40:44] + alpaca_instructions[10:14]
    bodies = {"g0": {"input": texts[0], "model": "text-embedding-3-small"},
              "list": {"input": texts[1:5]},  # 4 texts in shards of 3 rows: the request spans two shards
              "b64": {"input": [texts[5], texts[6]], "encoding_format": "base64"},
              "empty": {"input": [texts[7], " "]},  # one empty text: the whole request is an error line
              "ids": {"input": [[1, 2, 3]]}}
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(_line(cid, {**b, "dimensions": 128}) + "\n" for cid, b in bodies.items()))
    out = tmp_path / "out"
    args = ["run", str(requests), str(out), "--model", minilm_folder, "--rows-per-shard", "3", "--dtype", "float32",
            "--scheduler", shared_cluster, "--json"]
    res = runner.invoke(app, args)  # no --task: the file's endpoint makes it an embed job
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert (summary["rows"], summary["rows_error"], summary["output_tokens"]) == (10, 2, 0)
    assert pq.read_schema(next((out / "results").glob("*.parquet"))).field("embedding").type == pa.list_(
        pa.float32(), 128)
    assert "share their id" not in res.stderr  # a list's rows are custom_id[i]: unique

    exported = runner.invoke(app, ["export", str(out)])
    assert exported.exit_code == 0, exported.output
    assert "exported 3 responses and 2 errors" in exported.stderr
    got = {g["custom_id"]: g for g in map(json.loads, exported.stdout.splitlines())}
    assert list(got) == list(bodies)  # each request once, in input order
    from openai.types import BatchError, BatchRequestCounts, CreateEmbeddingResponse  # 0.6 s: not at collection

    counts = BatchRequestCounts(completed=3, failed=2, total=5)
    assert counts.total == len(got) and sum(g["error"] is not None for g in got.values()) == counts.failed
    for cid in ("empty", "ids"):
        assert got[cid]["response"] is None
        BatchError.model_validate(got[cid]["error"])
    assert got["empty"]["error"]["message"].startswith("input[1]: the text is only whitespace")
    assert "token-id inputs are not supported" in got["ids"]["error"]["message"]

    for cid in ("g0", "list", "b64"):
        line = got[cid]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        body = line["response"]["body"]
        inputs = bodies[cid]["input"] if isinstance(bodies[cid]["input"], list) else [bodies[cid]["input"]]
        if cid == "b64":  # OpenAI's base64: little-endian float32 bytes
            for d in body["data"]:
                d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
        parsed = CreateEmbeddingResponse.model_validate(body)
        assert parsed.object == "list" and [d.index for d in parsed.data] == list(range(len(inputs)))
        assert all(len(d.embedding) == 128 for d in parsed.data)
        want = minilm.embed(inputs, dimensions=128)
        assert _cosines([d.embedding for d in parsed.data], [o.embedding for o in want]).min() >= 0.99999
        assert parsed.usage.prompt_tokens == parsed.usage.total_tokens == sum(o.num_prompt_tokens for o in want)
    assert got["g0"]["response"]["body"]["request_model"] == "text-embedding-3-small"
    assert runner.invoke(app, ["export", str(out)]).stdout == exported.stdout  # stable ids: the same file
    dry = runner.invoke(app, ["run", str(requests), str(tmp_path / "dry"), "--model", minilm_folder, "--dry-run",
                              "--json"])  # the forecast of the file: an embed job of its 10 texts, 2 error rows
    assert dry.exit_code == 0, dry.output
    fc = json.loads(dry.stdout.strip().splitlines()[-1])
    assert (fc["task"], fc["rows"], fc["output_tokens"]) == ("embed", 10, 0) and fc["rows_per_dollar"] > 0
    assert not (tmp_path / "dry").exists()

    # A file whose requests ask for different dimensions, or a --task it cannot run: exit 2, one line, no OUTPUT.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(_line("a", {"input": texts[0]}) + "\n" + _line("b", {"input": texts[1], "dimensions": 64}) + "\n")
    for path, extra, message in ((mixed, [], "asks for different body.dimensions"),
                                 (requests, ["--task", "classify"], "holds /v1/embeddings requests, which run as "
                                                                    "--task embed; drop --task classify")):
        refused = runner.invoke(app, ["run", str(path), str(tmp_path / "no"), "--model", minilm_folder, *extra])
        assert refused.exit_code == 2 and message in refused.stderr, refused.output
        assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "no").exists()
