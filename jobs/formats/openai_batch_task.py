"""The task of a job whose input is an OpenAI batch file: its requests' endpoint picks it, before any check or work.

/v1/embeddings requests run as --task embed (jobs.formats.openai_embeddings), /v1/chat/completions and
/v1/completions as --task generate. The endpoint is the file's first well-formed request's, as
jobs.formats.openai_batch.parse_batch_lines takes it (the lines to another endpoint become error rows); only the lines
up to that one are read here. --task generate is the default, so it is taken as unset; another --task must agree with
the file.
"""

from __future__ import annotations

import json

import fsspec

from jobs.errors import JobError
from jobs.formats.jsonl_lines import batch_file_lines
from jobs.formats.openai_batch import is_openai_batch, request_values
from jobs.formats.openai_embeddings import EMBEDDINGS_URL
from schemas.job_spec import JobSpec


def file_endpoint(url: str) -> str | None:
    """The endpoint of the OpenAI batch file at `url`: its first well-formed request's url; None when it has none
    or cannot be read (read_batch_file says why when the job stages it)."""
    fs, path = fsspec.core.url_to_fs(url)
    try:
        with fs.open(path, "rb") as f:
            for line in batch_file_lines(f, url):
                try:
                    return request_values(json.loads(line), None)[0]
                except ValueError:  # not UTF-8, not JSON or not a request (BadRequest): the next line
                    continue
    except FileNotFoundError:
        return None
    return None


def batch_task(spec: JobSpec) -> JobSpec:
    """`spec`, with task embed when its input is an OpenAI batch file of /v1/embeddings requests and it asked for the
    default task (generate). Raises JobError (exit 2, one line) when --task embed, classify or score meets a file of
    another endpoint's requests, or --task classify or score a file of embeddings."""
    if not is_openai_batch(spec.input):
        return spec
    endpoint = file_endpoint(spec.input)
    if endpoint is None:
        return spec
    task = "embed" if endpoint == EMBEDDINGS_URL else "generate"
    if spec.task == task:
        return spec
    if spec.task == "generate":
        return spec.replace(task=task)
    raise JobError(f"the OpenAI batch file {spec.input} holds {endpoint} requests, which run as --task {task}; drop "
                   f"--task {spec.task}")
