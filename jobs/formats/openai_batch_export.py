"""OpenAI Batch API files out: the rows of a job whose input was an OpenAI batch file (jobs.formats.openai_batch) in the
OpenAI batch output format.

`tokenmill export OUTPUT --format openai-batch` writes the OpenAI batch output format, one line per row in
input order: `id`, `custom_id`, `response` {`status_code` 200, `request_id`, `body`: a chat.completion or
text_completion object with `choices` and `usage`} and `error` null; an error row has `response` null and `error`
{`code`, `message`}. With n > 1 the body has n `choices`; with logprobs each choice has them in OpenAI's shape
(chat: `logprobs.content` [{token, logprob, bytes, top_logprobs}]; completions: `logprobs` {tokens, token_logprobs,
top_logprobs, text_offset}, text_offset in characters from the start of the prompt, as OpenAI's legacy completions
count it without echo: the first token's offset is the prompt's length). The body's `model` is the model that ran;
`request_model` beside it is the request's own `model`, when it named one (the job's model replaced it).

An embed job's rows (`/v1/embeddings` requests, or any embed job's input rows: one line each) come out as OpenAI
writes embeddings: the body is `{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": floats,
or base64 of the little-endian float32 bytes when the request's encoding_format was base64}], "model", "usage":
{"prompt_tokens", "total_tokens"}}`, data[i] being the request's input[i] (its staged rows, joined back: a request
whose rows are not all committed yet is missing, with its shard); a request one of whose texts is an error row is
an error line naming that input's index.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import pyarrow.parquet as pq

from jobs.errors import JobError
from pipeline.input import Shard
from pipeline.layout import MANIFEST, STAGED_REQUESTS
from pipeline.manifest import InputManifest, read_manifest
from pipeline.record import ShardRecord
from pipeline.storage import read_fs, read_table


@dataclass(frozen=True)
class ExportCounts:
    """What export_openai_batch wrote: response lines, error lines, and the shards that have no committed results
    yet (their rows are missing from the file)."""

    responses: int
    errors: int
    missing_shards: tuple[str, ...]


def _stable_id(*parts: str) -> str:
    return uuid.uuid5(uuid.NAMESPACE_URL, "/".join(parts)).hex


def _is_chat(manifest: InputManifest) -> bool:
    """Chat-shaped responses when rows went through the chat template (messages, or text with the template)."""
    return manifest.prompt_column == manifest.options.get("messages_column") or bool(
        manifest.options.get("use_chat_template"))


def _input_reader(manifest: InputManifest) -> Callable[[Shard, str], list[Any] | None]:
    """read(shard, column): the input file's values of `column` (all its rows, indexed by input_row), or None when
    the file has no such column; each file's column is read once."""
    cache: dict[tuple[str, str], list[Any] | None] = {}

    def read(shard: Shard, column: str) -> list[Any] | None:
        key = (shard.url, column)
        if key not in cache:
            fs, path = read_fs(shard.url)
            with fs.open(path, "rb") as f:
                names = pq.ParquetFile(f).schema_arrow.names
            cache[key] = read_table(fs, path, [column]).column(column).to_pylist() if column in names else None
        return cache[key]
    return read


def batch_output_lines(output_url: str) -> Iterator[dict[str, Any] | str]:
    """The OpenAI batch output objects of the job at OUTPUT, one per committed result row in input order (shards in
    manifest order, rows in shard order); then, for each shard without committed results, its id (a str).
    Ids (`id`, `request_id`, the body's `id`) are stable: the same job exports the same file. Raises JobError
    (exit 2) when no job started at OUTPUT."""
    manifest = read_manifest(output_url)
    if manifest is None:
        raise JobError(f"no job at {output_url}: its input manifest ({MANIFEST}) is missing")
    fs, root = read_fs(output_url)
    chat = _is_chat(manifest)
    read_input = _input_reader(manifest)
    pending: list[dict[str, Any]] = []  # an embeddings request's rows read so far (they may span shards)
    for shard in manifest.shards():
        record = ShardRecord(fs, root, shard.shard_id)
        accounting = record.accounting
        if accounting is None:
            pending.clear()
            yield shard.shard_id
            continue
        created = int(accounting["finished_at"].timestamp())
        rows = record.results().to_pylist()
        if rows and "embedding" in rows[0]:
            yield from _embedding_lines(manifest, shard, rows, read_input, pending)
            continue
        # Completions' text_offset counts from the prompt's start; staged batch files keep each request's model.
        need_prompts = not chat and any(r["logprobs"] is not None or r.get("samples") for r in rows)
        prompts = read_input(shard, manifest.prompt_column) if need_prompts else None
        request_models = read_input(shard, "request_model") if manifest.input.endswith(STAGED_REQUESTS) else None
        for row in rows:
            key = _stable_id(manifest.input, manifest.created_at, row["id"])
            line: dict[str, Any] = {"id": f"batch_req_{key}", "custom_id": row["id"]}
            if row["error"] is not None:
                yield {**line, "response": None, "error": {"code": "invalid_request", "message": row["error"]}}
                continue
            samples = row.get("samples") or [row]  # results written before n, logprobs existed have neither
            start = len(prompts[row["input_row"]] or "") if prompts else 0
            requested = request_models[row["input_row"]] if request_models else None
            body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{key}",
                    "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": row["model"], **({"request_model": requested} if requested else {}),
                    "choices": [_choice(i, s, chat, start) for i, s in enumerate(samples)],
                    "usage": {"prompt_tokens": row["prompt_tokens"], "completion_tokens": row["completion_tokens"],
                              "total_tokens": row["prompt_tokens"] + row["completion_tokens"]}}
            yield {**line, "response": {"status_code": 200, "request_id": f"req_{key}", "body": body}, "error": None}


def _embedding_lines(manifest: InputManifest, shard: Shard, rows: list[dict[str, Any]],
                     read_input: Callable[[Shard, str], list[Any] | None],
                     pending: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The /v1/embeddings output lines of one shard's embed rows, each request's rows joined in input_index order
    (staged columns custom_id, input_index, input_count; an input without them: one row a request, its id).
    `pending` holds the rows of a request started in an earlier shard, and those of one this shard starts but does
    not end; rows of a request whose first rows are missing (their shard not committed) are skipped."""
    index, count = read_input(shard, "input_index"), read_input(shard, "input_count")
    formats, models = read_input(shard, "encoding_format"), read_input(shard, "request_model")
    custom_ids = read_input(shard, "custom_id")
    for row in rows:
        r = row["input_row"]
        i = index[r] if index else 0
        if i == 0:
            pending.clear()
        if i != len(pending):
            pending.clear()
            continue
        pending.append({**row, "custom_id": custom_ids[r] if custom_ids else row["id"]})
        if len(pending) == (count[r] if count else 1):
            yield _embedding_line(manifest, list(pending), formats[r] if formats else "float",
                                  models[r] if models else None)
            pending.clear()


def _embedding_line(manifest: InputManifest, rows: list[dict[str, Any]], encoding_format: str,
                    requested: str | None) -> dict[str, Any]:
    """One /v1/embeddings output line of a request's rows (input order): its data, model and usage (prompt tokens,
    tokens), or an error line naming the first input that failed."""
    key = _stable_id(manifest.input, manifest.created_at, rows[0]["custom_id"])
    line: dict[str, Any] = {"id": f"batch_req_{key}", "custom_id": rows[0]["custom_id"]}
    failed = [(i, row["error"]) for i, row in enumerate(rows) if row["error"] is not None]
    if failed:
        i, message = failed[0]
        where = f"input[{i}]: " if len(rows) > 1 else ""
        return {**line, "response": None, "error": {"code": "invalid_request", "message": where + message}}

    def vector(values: list[float]) -> list[float] | str:
        if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
            return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
        return values

    tokens = sum(row["prompt_tokens"] for row in rows)
    body = {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": vector(row["embedding"])}
                                       for i, row in enumerate(rows)],
            "model": rows[0]["model"], **({"request_model": requested} if requested else {}),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return {**line, "response": {"status_code": 200, "request_id": f"req_{key}", "body": body}, "error": None}


def _choice(index: int, sample: dict[str, Any], chat: bool, prompt_chars: int = 0) -> dict[str, Any]:
    """One `choices[]` entry of a response body from a result row or one of its samples, logprobs in OpenAI's
    shape for the endpoint (None when not asked for); a completion's text_offset starts at `prompt_chars`, the
    prompt's length in characters (OpenAI's legacy field counts from the prompt's start)."""
    text, logprobs = sample["completion"], sample.get("logprobs")
    if logprobs is None:
        shaped = None
    elif chat:
        def entry(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        shaped = {"content": [{**entry(e["token"], e["logprob"]),
                               "top_logprobs": [entry(t["token"], t["logprob"]) for t in e["top_logprobs"]]}
                              for e in logprobs], "refusal": None}
    else:
        offsets, at = [], prompt_chars
        for e in logprobs:
            offsets.append(at)
            at += len(e["token"])
        shaped = {"tokens": [e["token"] for e in logprobs], "token_logprobs": [e["logprob"] for e in logprobs],
                  "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in logprobs],
                  "text_offset": offsets}
    content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"index": index, **content, "logprobs": shaped, "finish_reason": sample["finish_reason"]}


def export_openai_batch(output_url: str, dest: IO[str]) -> ExportCounts:
    """Write the job's rows to `dest` in the OpenAI batch output format (batch_output_lines), one JSON object per
    line. Returns the counts; rows of shards not committed yet are missing (their shard ids are listed)."""
    responses = errors = 0
    missing: list[str] = []
    for item in batch_output_lines(output_url):
        if isinstance(item, str):
            missing.append(item)
            continue
        dest.write(json.dumps(item, ensure_ascii=False) + "\n")
        if item["error"] is None:
            responses += 1
        else:
            errors += 1
    return ExportCounts(responses, errors, tuple(missing))
