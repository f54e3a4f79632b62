"""OpenAI Batch API `/v1/embeddings` requests in: a request line's body as rows of an embed job.

A line `{"custom_id", "method": "POST", "url": "/v1/embeddings", "body": {"model", "input", "encoding_format",
"dimensions", "user"}}` (jobs.formats.openai_batch reads the file) becomes one staged row per text of its `input`
(a string: one row; a list of strings: one row each, in order): `id` (the custom_id; `custom_id[i]` for the texts
of a list, so the results' ids stay unique), `custom_id`, `prompt` (the text), `input_index` (its place in the list,
0-based), `input_count` (the list's length), `encoding_format` and
`dimensions` (the request's, for the export), `request_error` and `request_model`. The job then runs with --task
embed (jobs.formats.openai_batch_task) and the export (jobs.formats.openai_batch_export) joins each request's rows
back into one response whose `data[i]` is input[i]'s embedding.

Decided here: token-id inputs (lists of integers) are not supported (an error line: send text); an empty list or an
empty text is an error line, as OpenAI answers them; `dimensions` is one per job, since the results' `embedding`
column has one width: a file whose requests ask for different `dimensions` (a number here, none there) is refused
before any work (exit 2, file_dimensions), and so is a --dimensions that differs from the file's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

from jobs.errors import JobError

EMBEDDINGS_URL = "/v1/embeddings"
ENCODING_FORMATS = ("float", "base64")
_FIELDS = ("model", "input", "encoding_format", "dimensions", "user")
#: The staged table of an embeddings file (one row per input text).
EMBEDDINGS_COLUMNS = {"id": pa.string(), "custom_id": pa.string(), "prompt": pa.string(), "input_index": pa.int32(),
                      "input_count": pa.int32(), "encoding_format": pa.string(), "dimensions": pa.int64(),
                      "request_error": pa.string(), "request_model": pa.string()}


class BadRequest(ValueError):
    """One request line that cannot be mapped; the message names the problem and the fix."""


def embedding_values(body: dict[str, Any]) -> dict[str, Any]:
    """The row values of a /v1/embeddings request body: `inputs` (the texts, in order), `encoding_format` (float when
    absent), `dimensions` (None when absent) and `request_model`. Raises BadRequest naming the field and the fix."""
    unsupported = sorted(k for k in body if k not in _FIELDS)
    if unsupported:
        raise BadRequest(f"body fields {unsupported} are not supported for {EMBEDDINGS_URL}; remove them")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts:
        raise BadRequest("body.input must be a text or a non-empty list of texts for /v1/embeddings")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise BadRequest(f"body.input[{i}] is {type(text).__name__}, not text; token-id inputs are not "
                             "supported: send the text")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise BadRequest(f"body.encoding_format must be float or base64, got {fmt!r}")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise BadRequest(f"body.dimensions must be an integer >= 1, got {dims!r}")
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return {"inputs": texts, "encoding_format": fmt, "dimensions": dims, "request_model": model}


def embedding_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    """The staged table (EMBEDDINGS_COLUMNS) of parsed lines: `rows` as jobs.formats.openai_batch.parse_batch_lines
    builds them (id plus embedding_values' values, or id plus request_error). A line of n texts becomes n rows; an
    error line one row with no text (its request_error says why)."""
    out: list[dict[str, Any]] = []
    for row in rows:
        texts = row.get("inputs") or [None]
        common = {k: row.get(k) for k in ("encoding_format", "dimensions", "request_error", "request_model")}
        cid, n = row["id"], len(texts)
        out.extend({**common, "id": cid if n == 1 else f"{cid}[{i}]", "custom_id": cid, "prompt": text,
                    "input_index": i, "input_count": n} for i, text in enumerate(texts))
    return pa.Table.from_pylist(out, schema=pa.schema(list(EMBEDDINGS_COLUMNS.items())))


def file_dimensions(table: pa.Table, url: str) -> int | None:
    """The `dimensions` every well-formed request of an embeddings file asks for (None: the model's whole width).
    Raises JobError (exit 2) when requests ask for different ones (one job writes one width), naming a custom_id of
    each and the fix."""
    seen: dict[int | None, str] = {}
    for cid, dims, error in zip(*(table.column(c).to_pylist() for c in ("custom_id", "dimensions", "request_error")),
                                strict=True):
        if error is None:
            seen.setdefault(dims, cid)
    if len(seen) > 1:
        asked = "; ".join(f"{'none' if d is None else d} (custom_id {c!r})" for d, c in seen.items())
        raise JobError(f"the OpenAI batch file {url!r} asks for different body.dimensions: {asked}; a job writes one "
                       "width: split the file by dimensions and run each into its own OUTPUT")
    return next(iter(seen), None)


def job_dimensions(asked: int | None, file: int | None) -> int | None:
    """The dimensions of an embeddings batch job: the file's, or the job's --dimensions (`asked`) where the file's
    requests ask for none. Raises JobError (exit 2) when both are set and differ."""
    if asked is not None and file is not None and asked != file:
        raise JobError(f"--dimensions {asked} differs from the body.dimensions {file} the batch file's requests ask "
                       "for; drop --dimensions (the file's value is used) or run a file without dimensions")
    return file if file is not None else asked
