"""OpenAI Batch API files in: a thin conversion around the native Parquet job.

In: `tokenmill run requests.jsonl OUTPUT` takes the OpenAI batch input format (one JSON request per line:
`custom_id`, `method` POST, `url` /v1/chat/completions or /v1/completions, `body` with `messages` (text, or content
parts of text and image_url: jobs.formats.openai_chat) or `prompt` and sampling fields; or `url` /v1/embeddings:
an embed job, jobs.formats.openai_embeddings). The lines are converted
once into a Parquet file under OUTPUT/_input/ (create-only, with the JSONL's size and version in its metadata) that
the job then runs like any Parquet input: the same manifest,
exactly-once commits, resume and accounting. `custom_id` becomes the row id; the body's sampling fields become
per-row sampling columns (pipeline.row_options), so a row's own values win over the job's: max_tokens
(max_completion_tokens), temperature, top_p, top_k, seed, stop, n, presence_penalty, frequency_penalty, logit_bias,
vLLM's repetition_penalty and min_tokens, `logprobs` (chat: true, with `top_logprobs` 0-20; completions: the
number of top logprobs) and `response_format` ({"type": "json_schema", "json_schema": {"schema": ...}} or
{"type": "json_object"}; vLLM's guided_json, guided_regex and guided_choice too). Ranges are checked when the row runs,
by the same rules as the job's options (schemas.sampling). A line that cannot be mapped (not JSON, another endpoint,
a field we do not support such as tools or streaming) becomes an error row whose `request_error` names the problem.
A file holds requests to one endpoint, its first well-formed line's: a line to another is an error row (so a file
mixing chat and embeddings runs the kind its first request is, the others' lines answered with errors).

Out: jobs.formats.openai_batch_export (`tokenmill export OUTPUT --format openai-batch`).

NOTE: the lines are parsed one by one with json.loads rather than by pyarrow's or polars' JSON readers: those fail
the whole file on one malformed line, and a malformed line must become an error row.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import fsspec
import pyarrow as pa

from jobs.errors import JobError
from jobs.formats.jsonl_lines import batch_file_lines
from jobs.formats.openai_chat import chat_messages, messages_as_json
from jobs.formats.openai_embeddings import (
    EMBEDDINGS_URL,
    embedding_table,
    embedding_values,
    file_dimensions,
    job_dimensions,
)
from jobs.formats.openai_embeddings import BadRequest as _BadRequest
from pipeline.input import absolute_url, file_version
from pipeline.layout import staged_requests_path
from pipeline.row_options import ROW_ERROR_COLUMN
from pipeline.storage import commit_table, exists_now, output_fs, read_fs, read_table
from schemas.job_spec import Columns, JobSpec
from schemas.sampling import SAMPLING_RANGES

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# Body fields we accept when they ask for nothing we do not do: field -> the values that are fine.
_NEUTRAL = {"stream": (False, None), "echo": (False, None), "parallel_tool_calls": (False, None),
            "tool_choice": ("none", None)}
_IGNORED = ("model", "user", "metadata", "store")  # the job's model runs every row (`model` is kept as request_model)
# Body fields with the sampling field's own name and range (schemas.sampling), but logprobs (see _sampling).
_NUMERIC = tuple(name for name in SAMPLING_RANGES if name != "logprobs")
_OTHER = ("max_completion_tokens", "stop", "logprobs", "top_logprobs", "logit_bias", "response_format",
          "guided_json", "guided_regex", "guided_choice")

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_COLUMNS = {"id": pa.string(), "messages": pa.list_(_MESSAGE), "prompt": pa.string(),
            **{name: pa.int64() if SAMPLING_RANGES[name].integer else pa.float64() for name in SAMPLING_RANGES},
            "stop": pa.list_(pa.string()), "logit_bias": pa.string(), "json_schema": pa.string(),
            "json_object": pa.bool_(), "regex": pa.string(), "choices": pa.list_(pa.string()),
            ROW_ERROR_COLUMN: pa.string(), "request_model": pa.string()}
log = logging.getLogger(__name__)


def is_openai_batch(url: str) -> bool:
    """Whether INPUT names an OpenAI batch file (a .jsonl file, local or an fsspec URL)."""
    return url.rstrip("/").lower().endswith(".jsonl")


def _check_number(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise _BadRequest(f"body.{name} must be a {'integer' if kind is int else 'number'}, got {value!r}")
    return value


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _BadRequest("body.prompt must be one text prompt for /v1/completions (lists of prompts and token ids "
                          "are not supported: one request per line)")
    return prompt


def _sampling(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The body's sampling fields under pipeline.row_options' names; types checked (ranges: at run time, by
    engine.SamplingParams, the same rules as the job's options)."""
    values = {name: _check_number(body, name, int if SAMPLING_RANGES[name].integer else (int, float))
              for name in _NUMERIC}
    max_completion = _check_number(body, "max_completion_tokens", int)
    if max_completion is not None:
        values["max_tokens"] = max_completion
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise _BadRequest(f"body.stop must be a non-empty string or a list of them, got {stop!r}")
    values["stop"] = stop
    values["logprobs"] = _logprobs(body, chat)
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise _BadRequest(f"body.logit_bias must be an object {{\"token id\": bias}}, got {bias!r}")
    values["logit_bias"] = None if bias is None else json.dumps(bias)
    return {**values, **_response_format(body)}


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """The number of top logprobs asked for (None: no logprobs): chat's `logprobs` true with `top_logprobs` (0 when
    absent), completions' `logprobs` integer."""
    logprobs, top = body.get("logprobs"), _check_number(body, "top_logprobs", int)
    if chat:
        if logprobs not in (None, True, False):
            raise _BadRequest(f"body.logprobs must be true or false for {CHAT_URL}, got {logprobs!r}")
        if top is not None and not logprobs:
            raise _BadRequest("body.top_logprobs needs body.logprobs true")
        return (top or 0) if logprobs else None
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise _BadRequest(f"body.logprobs must be an integer (top logprobs) for {COMPLETIONS_URL}, got {logprobs!r}")
    return logprobs


def _response_format(body: dict[str, Any]) -> dict[str, Any]:
    """The structured output columns of OpenAI's response_format (json_schema, json_object; text = none) and of
    vLLM's guided_json / guided_regex / guided_choice."""
    out: dict[str, Any] = {}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise _BadRequest("body.response_format.json_schema.schema must be a JSON Schema object")
            out["json_schema"] = json.dumps(schema)
        elif kind == "json_object":
            out["json_object"] = True
        elif kind != "text":
            raise _BadRequest(f"body.response_format {fmt!r} is not supported; use type json_schema, json_object or "
                              "text")
    guided = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choices"}
    for field, column in guided.items():
        value = body.get(field)
        if value is None:
            continue
        if field == "guided_json":
            value = json.dumps(value) if isinstance(value, dict) else value
        if (field == "guided_choice" and not (isinstance(value, list) and all(isinstance(c, str) for c in value))) \
                or (field != "guided_choice" and not isinstance(value, str)):
            raise _BadRequest(f"body.{field} has the wrong type: {value!r}")
        out[column] = value
    return out


def request_values(doc: Any, endpoint: str | None) -> tuple[str, dict[str, Any]]:
    """(url, row values) of one parsed line (`endpoint`: the file's, None before its first). Raises _BadRequest."""
    if not isinstance(doc, dict):
        raise _BadRequest("a line must be a JSON object {custom_id, method, url, body}")
    url, body = doc.get("url"), doc.get("body")
    if url not in (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL):
        raise _BadRequest(f"url {url!r} is not supported; use {CHAT_URL}, {COMPLETIONS_URL} or {EMBEDDINGS_URL}")
    if endpoint is not None and url != endpoint:
        raise _BadRequest(f"url {url!r} differs from this file's endpoint {endpoint!r} (its first request); a batch "
                          "file holds requests to one endpoint: put these in a file of their own")
    if doc.get("method", "POST") != "POST":
        raise _BadRequest(f"method {doc.get('method')!r} is not supported; batch requests are POST")
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object with the request")
    if url == EMBEDDINGS_URL:
        return url, embedding_values(body)
    unsupported = sorted(k for k in body if k not in (*_NUMERIC, *_OTHER, *_IGNORED, *_NEUTRAL, "messages", "prompt")
                         or (k in _NEUTRAL and body[k] not in _NEUTRAL[k]))
    if unsupported:
        raise _BadRequest(f"body fields {unsupported} are not supported (no streaming, echo or tools); remove them")
    prompt = {"messages": chat_messages(body)} if url == CHAT_URL else {"prompt": _prompt(body)}
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return url, {**prompt, **_sampling(body, url == CHAT_URL), "request_model": model}


def parse_batch_lines(lines: Iterable[str | bytes]) -> tuple[pa.Table, str]:
    """Convert OpenAI batch input lines into the job's input table and the file's endpoint.

    `lines` are text, or raw bytes (decoded here as UTF-8, one line at a time: see batch_file_lines). Returns a table
    with columns id (custom_id; "line-<n>" when a line has none), messages (chat) or prompt (completions), the
    per-row sampling columns (null where the request does not set them), request_error (null, or why the line
    cannot run, naming its line number and the fix) and request_model (the body's `model`, which the job's model
    replaces: the export writes it beside ours). Blank lines are skipped. A line that is not UTF-8 or not JSON is
    an error row; a repeated custom_id makes the later line an error row. The endpoint is that of the first
    well-formed line (chat when there is none). Warns once (logging) when requests name models (the job's runs them)
    or set max_tokens and max_completion_tokens to different values (max_completion_tokens is taken, as vLLM does).
    """
    rows: list[dict[str, Any]] = []
    both: list[str] = []  # "custom_id (max_tokens, max_completion_tokens)" of requests that set both, differently
    endpoint: str | None = None
    seen: dict[str, int] = {}
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        custom_id = f"line-{line_no}"
        try:
            try:
                if isinstance(line, bytes):
                    line = line.decode("utf-8")
                doc = json.loads(line)
            except UnicodeDecodeError as e:
                raise _BadRequest(f"not valid UTF-8 (byte {e.start + 1} of the line, {e.object[e.start:e.end]!r}: "
                                  f"{e.reason}); save the file as UTF-8") from e
            except json.JSONDecodeError as e:
                raise _BadRequest(f"not valid JSON ({e})") from e
            if isinstance(doc, dict) and isinstance(doc.get("custom_id"), str) and doc["custom_id"]:
                custom_id = doc["custom_id"]
            else:
                raise _BadRequest("custom_id must be a non-empty string")
            if custom_id in seen:
                raise _BadRequest(f"custom_id {custom_id!r} repeats line {seen[custom_id]}; custom_ids must be unique")
            seen[custom_id] = line_no
            url, values = request_values(doc, endpoint)
            body = doc["body"]
            if body.get("max_completion_tokens") is not None and body.get("max_tokens") not in (
                    None, body["max_completion_tokens"]):
                both.append(f"{custom_id} ({body['max_tokens']}, {body['max_completion_tokens']})")
            endpoint = endpoint or url
            rows.append({"id": custom_id, **values})
        except _BadRequest as e:
            seen.setdefault(custom_id, line_no)
            rows.append({"id": custom_id, ROW_ERROR_COLUMN: f"line {line_no}: {e}"})
    endpoint = endpoint or CHAT_URL
    _warn_once(both, sorted({r["request_model"] for r in rows if r.get("request_model")}))
    if endpoint == EMBEDDINGS_URL:
        return embedding_table(rows), endpoint
    types = {**_COLUMNS, "messages": pa.string()} if messages_as_json(rows) else _COLUMNS  # image parts
    schema = pa.schema([(name, t) for name, t in types.items()
                        if name != ("prompt" if endpoint == CHAT_URL else "messages")])
    return pa.Table.from_pylist(rows, schema=schema), endpoint


def _warn_once(both: list[str], models: list[str]) -> None:
    """The batch file's two silent substitutions, each said once per file (a job stages its file once)."""
    if both:
        log.warning("%d requests set both max_tokens and max_completion_tokens, to different values (%s%s); "
                    "max_completion_tokens is used (vLLM's rule; max_tokens is its older name)", len(both),
                    ", ".join(both[:3]), ", ..." if len(both) > 3 else "")
    if models:
        log.warning("requests name the model%s %s; every row runs the job's model (--model) instead: the export "
                    "writes each request's name as request_model beside the model that ran", "s" * (len(models) > 1),
                    ", ".join(models[:5]) + (", ..." if len(models) > 5 else ""))


def read_batch_file(url: str) -> tuple[pa.Table, str, dict[str, str]]:
    """Parse the OpenAI batch file at `url` (local or fsspec URL): (table, endpoint, source metadata: its URL, size
    and version). Raises JobError (exit 2) when it cannot be read."""
    fs, path = fsspec.core.url_to_fs(url)
    try:
        size, version = file_version(fs, path)
        with fs.open(path, "rb") as f:
            table, endpoint = parse_batch_lines(batch_file_lines(f, url))
    except FileNotFoundError as e:
        raise JobError(f"cannot read the OpenAI batch file {url!r}: {e}; give a UTF-8 .jsonl file") from e
    if table.num_rows == 0:
        raise JobError(f"the OpenAI batch file {url!r} holds no requests")
    source = {"source": absolute_url(url), "size": str(size), "version": version, "endpoint": endpoint}
    if endpoint == EMBEDDINGS_URL:
        source["dimensions"] = str(file_dimensions(table, url) or "")
    return table, endpoint, source


def stage_batch_file(input_url: str, output_url: str,
                     check: Callable[[dict[str, str]], object] | None = None) -> tuple[str, dict[str, str]]:
    """Convert the batch file into OUTPUT/_input/requests.parquet (create-only) and return (its URL, its metadata:
    source, size, version, endpoint; for /v1/embeddings the requests' dimensions, "" for none).

    A job that already staged it reuses it when the batch file is the same one (URL, size, version); a batch file
    that changed since the job started raises JobError (exit 2), as a changed Parquet input fails its shards. A
    batch file refused as unreadable (read_batch_file), or by `check(metadata)` (called before the first staging;
    what it raises propagates), creates nothing: OUTPUT's folder is made only to stage.
    """
    fs, root = read_fs(output_url)
    staged = staged_requests_path(root)
    if not exists_now(fs, staged):
        table, _, source = read_batch_file(input_url)  # a file refused here leaves no OUTPUT folder behind
        if check is not None:
            check(source)
        meta = {f"tokenmill.{k}".encode(): v.encode() for k, v in source.items()}
        fs, root = output_fs(output_url)
        commit_table(fs, staged, table.replace_schema_metadata(meta))
    meta = {k.decode().removeprefix("tokenmill."): v.decode()
            for k, v in (read_table(fs, staged).schema.metadata or {}).items() if k.startswith(b"tokenmill.")}
    src_fs, src_path = fsspec.core.url_to_fs(input_url)
    try:
        now = file_version(src_fs, src_path)
    except FileNotFoundError:
        now = None
    if meta.get("source") != absolute_url(input_url) or now != (int(meta["size"]), meta["version"]):
        raise JobError(f"{output_url} holds a job started from {meta.get('source')} ({meta.get('size')} bytes, "
                       f"version {meta.get('version')}); {input_url} is another file or has changed since. Restore "
                       "it, or run the new batch file into a new OUTPUT")
    return fs.unstrip_protocol(staged), meta


def batch_spec(spec: JobSpec, staged_url: str, meta: dict[str, str]) -> JobSpec:
    """The spec that runs the staged requests (`meta`: read_batch_file's source metadata): ids from custom_id,
    chat requests' messages through the chat template, completions' prompts raw, the job's allow_special_tokens
    kept; /v1/embeddings: task embed, the requests' dimensions (job_dimensions). Raises JobError (exit 2)."""
    endpoint = meta["endpoint"]
    columns = Columns(chat_template=endpoint == CHAT_URL, allow_special_tokens=spec.columns.allow_special_tokens)
    update: dict[str, object] = {"input": staged_url, "columns": columns}
    if endpoint == EMBEDDINGS_URL:
        dims = job_dimensions(spec.embedding.dimensions, int(meta["dimensions"]) if meta.get("dimensions") else None)
        update |= {"task": "embed", "embedding": spec.embedding.model_copy(update={"dimensions": dims})}
    return spec.model_copy(update=update)


def prepare_spec(spec: JobSpec, check: Callable[[JobSpec], object] | None = None) -> JobSpec:
    """`spec` itself, or, when its input is an OpenAI batch file, the spec that runs the staged conversion of it
    (stage_batch_file: writes OUTPUT/_input/requests.parquet once; `check(spec)` is called on the spec that will run
    before it is staged, so bad options write nothing). Raises JobError (exit 2)."""
    if not is_openai_batch(spec.input):
        return spec
    staged, meta = stage_batch_file(spec.input, spec.output,
                                    None if check is None else lambda source: check(batch_spec(spec, "-", source)))
    return batch_spec(spec, staged, meta)
