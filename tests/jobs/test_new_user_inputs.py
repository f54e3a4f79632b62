"""Inputs a new user has that were refused though fine, or accepted though broken (issue 26 items 9, 10), on real
GSM8K rows: dictionary-encoded prompt columns written by polars, the conversion an error message suggests for a
column that is not text, and OpenAI batch files with a UTF-8 BOM or a line of invalid UTF-8.

The runs check what a job writes, not its own cluster: they run on the session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from jobs.cli import app
from jobs.errors import JobError
from jobs.formats.openai_batch import CHAT_URL, read_batch_file
from pipeline.config import InputError, RunConfig
from pipeline.input import resolve_inputs, validate_columns
from pipeline.input_columns import text_fix
from pipeline.shard import read_shard

runner = CliRunner()


@pytest.fixture()
def categorical_questions(tmp_path: Path, data_dir: Path) -> Path:
    """6 real GSM8K questions written by polars as a Categorical column (Parquet: dictionary<string>), with their
    ids as an Enum column, one question repeated so the dictionary is shared."""
    questions = pl.read_parquet(data_dir / "gsm8k_test.parquet", columns=["question"]).slice(300, 5)["question"]
    questions = questions.append(questions.slice(0, 1))
    ids = [f"q{i}" for i in range(6)]
    path = tmp_path / "categorical.parquet"
    pl.DataFrame({"id": pl.Series(ids, dtype=pl.Enum(ids)),
                  "question": pl.Series(questions, dtype=pl.Categorical)}).write_parquet(path)
    return path


def test_a_dictionary_encoded_prompt_column_runs(categorical_questions: Path, tmp_path: Path,
                                                 shared_cluster: str) -> None:
    """What polars writes for Categorical and Enum (and pandas for a categorical) is dictionary-encoded text in
    Parquet: the job runs it like any text column. It used to be refused as "not text"."""
    schema = pq.read_schema(categorical_questions)
    assert pa.types.is_dictionary(schema.field("question").type)  # the file is what a user really has
    assert pa.types.is_dictionary(schema.field("id").type)
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(categorical_questions), str(out), "--prompt-column", "question",
                              "--max-tokens", "3", "--scheduler", shared_cluster, "--json"])
    assert res.exit_code == 0, res.output
    results = pq.read_table(out / "results").sort_by("input_row")
    assert results.column("id").to_pylist() == [f"q{i}" for i in range(6)]
    assert results.column("error").null_count == 6 and set(results.column("finish_reason").to_pylist()) == {"length"}
    expected = pl.read_parquet(categorical_questions)["question"].cast(pl.String).to_list()
    rows = read_shard(_shard_of(categorical_questions), "question", "id")
    assert rows.prompts == expected and rows.ids == [f"q{i}" for i in range(6)]


def _shard_of(path: Path):  # noqa: ANN202 - a pipeline.input.Shard of the whole file
    from pipeline.input import Shard

    return Shard("00000-000000000", str(path), path.as_uri(), 0, pq.read_metadata(path).num_rows)


@pytest.mark.parametrize("make", [
    pytest.param(lambda q: pa.array(q, pa.large_string()), id="large_string"),
    pytest.param(lambda q: pa.array(q, pa.string_view()), id="string_view"),
    pytest.param(lambda q: pa.array(q).dictionary_encode(), id="dictionary"),
])
def test_every_arrow_text_type_is_a_prompt_column(make, tmp_path: Path, gsm8k_questions: list[str]) -> None:  # noqa: ANN001
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": make(gsm8k_questions[:3])}), path)
    fs, files = resolve_inputs(str(path))
    assert validate_columns(fs, files, RunConfig()) == "prompt"
    assert read_shard(_shard_of(path), "prompt", "id").prompts == gsm8k_questions[:3]


def test_dictionary_encoded_json_messages_are_a_messages_column(tmp_path: Path, gsm8k_questions: list[str]) -> None:
    texts = [json.dumps([{"role": "user", "content": q}]) for q in gsm8k_questions[:2]]
    path = tmp_path / "msgs.parquet"
    pq.write_table(pa.table({"messages": pa.array(texts).dictionary_encode()}), path)
    fs, files = resolve_inputs(str(path))
    assert validate_columns(fs, files, RunConfig()) == "messages"
    rows = read_shard(_shard_of(path), "messages", "id", messages=True)
    assert rows.prompts == [[{"role": "user", "content": q}] for q in gsm8k_questions[:2]]
    assert rows.errors == [None, None]


@pytest.mark.parametrize("values", [
    pytest.param(lambda q: pa.array([q[:2], [q[2]], None]), id="list<string>"),
    pytest.param(lambda q: pa.array([q[:2], [q[2]], None], pa.large_list(pa.large_string())), id="large_list"),
    pytest.param(lambda q: pa.array([{"text": q[0]}, {"text": q[1]}, None]), id="struct"),
    pytest.param(lambda q: pa.array([1, 2, None]), id="int64"),
    pytest.param(lambda q: pa.array([b"x", b"y", None]), id="binary"),
])
def test_the_suggested_conversion_of_a_column_that_is_not_text_works(values, tmp_path: Path,  # noqa: ANN001
                                                                      gsm8k_questions: list[str]) -> None:
    """The error names the column's type and a conversion; that conversion, run as printed, gives a text column
    the job accepts. The old advice, `.cast(pa.string())`, raises in pyarrow for a list column."""
    path = tmp_path / "in.parquet"
    table = pa.table({"prompt": values(gsm8k_questions)})
    pq.write_table(table, path)
    fs, files = resolve_inputs(str(path))
    with pytest.raises(InputError, match=r"not text") as refused:
        validate_columns(fs, files, RunConfig())
    fix = re.search(r"`table = (.+?)`", str(refused.value))
    assert fix is not None and fix.group(1) == text_fix("prompt", table.schema.field("prompt").type)
    fixed = eval(fix.group(1), {"pa": pa, "json": json, "table": pq.read_table(path)})  # noqa: S307 - our own hint
    pq.write_table(fixed, path)
    fs, files = resolve_inputs(str(path))
    assert validate_columns(fs, files, RunConfig()) == "prompt"
    texts = fixed.column("prompt").to_pylist()
    assert texts[2] is None and all(isinstance(t, str) and t for t in texts[:2])


def test_a_list_of_structs_as_the_prompt_column_points_at_messages(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "hi"}]]}), path)
    fs, files = resolve_inputs(str(path))
    with pytest.raises(InputError, match=r"chat messages, not text.*--messages-column prompt"):
        validate_columns(fs, files, RunConfig())


def _batch_line(custom_id: str, question: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
                       "body": {"model": "gpt-4o-mini", "max_tokens": 3,
                                "messages": [{"role": "user", "content": question}]}}, ensure_ascii=False).encode()


def test_a_batch_file_with_a_bom_and_a_line_of_invalid_utf8_runs_the_other_lines(tmp_path: Path,
                                                                                   gsm8k_questions: list[str],
                                                                                   shared_cluster: str) -> None:
    """Real bytes as Windows tools and a bad export write them: a UTF-8 byte order mark, CRLF line ends, and one line
    whose bytes are Latin-1 (invalid UTF-8). The BOM is skipped (the first request runs under its custom_id, it
    used to be an error row "Unexpected UTF-8 BOM" under id line-1); the bad line is that line's error row, named
    by its line number (it used to reject the whole file with a byte offset); every other line runs."""
    lines = [_batch_line(f"gsm8k-{i}", q) for i, q in enumerate(gsm8k_questions[:4])]
    lines[2] = _batch_line("gsm8k-2", "Caf\u00e9 au lait: " + gsm8k_questions[2]).replace(
        "Café".encode(), "Café".encode("latin-1"))
    assert b"Caf\xe9 " in lines[2]
    path = tmp_path / "requests.jsonl"
    path.write_bytes(codecs_bom() + b"\r\n".join(lines) + b"\r\n")
    table, endpoint, _ = read_batch_file(str(path))
    rows = table.to_pylist()
    assert endpoint == CHAT_URL and [r["id"] for r in rows] == ["gsm8k-0", "gsm8k-1", "line-3", "gsm8k-3"]
    assert [r["request_error"] is None for r in rows] == [True, True, False, True]
    assert rows[2]["request_error"].startswith("line 3: not valid UTF-8") and "save the file as UTF-8" in \
        rows[2]["request_error"]
    assert rows[0]["messages"] == [{"role": "user", "content": gsm8k_questions[0]}]

    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(path), str(out), "--scheduler", shared_cluster, "--json"])
    assert res.exit_code == 0, res.output
    results = {r["id"]: r for r in pq.read_table(out / "results").to_pylist()}
    assert sorted(results) == ["gsm8k-0", "gsm8k-1", "gsm8k-3", "line-3"]
    assert [results[k]["error"] is None for k in ("gsm8k-0", "gsm8k-1", "gsm8k-3")] == [True] * 3
    assert results["line-3"]["error"].startswith("line 3: not valid UTF-8")


def codecs_bom() -> bytes:
    import codecs

    return codecs.BOM_UTF8


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
def test_a_utf16_or_utf32_batch_file_is_refused_naming_its_encoding(encoding: str, tmp_path: Path,
                                                                    gsm8k_questions: list[str]) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_bytes(_batch_line("a", gsm8k_questions[0]).decode().encode(encoding))  # with the encoding's BOM
    with pytest.raises(JobError, match=rf"is {encoding.upper()} encoded .*save it as UTF-8"):
        read_batch_file(str(path))
    # `tokenmill run` refuses it (exit 2) and leaves nothing behind: no OUTPUT folder, empty or not.
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(path), str(out), "--json"])
    assert res.exit_code == 2 and f"is {encoding.upper()} encoded" in res.stderr, res.output
    assert not out.exists()
