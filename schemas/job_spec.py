"""The job spec: a YAML file that `tokenmill submit` runs, checked against a JSON Schema (JOB_SPEC_SCHEMA).

A spec names the input and output, the model, which columns hold what, how to sample, how to cut and checkpoint
shards, the cluster and the engine's limits. Only `input` and `output` are required; every other field has the
default of the matching `tokenmill run` option. Unknown fields are errors (a typo never silently becomes a
default). Example: infra/job.example.yaml.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import fsspec
import jsonschema
import yaml


def _obj(description: str, properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "description": description, "properties": properties,
            "required": list(required), "additionalProperties": False}


_NAME = {"type": "string", "minLength": 1}
_COUNT = {"type": "integer", "minimum": 1}

JOB_SPEC_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tokenmill job spec",
    **_obj("A tokenmill batch inference job.", {
        "input": {**_NAME, "description": "Parquet file, folder, glob or fsspec URL (s3://bucket/prefix/)."},
        "output": {**_NAME, "description": "Output folder or fsspec URL; results/, accounting/ and the job's "
                                           "records go there. One OUTPUT holds one job."},
        "model": {"type": ["string", "null"], "minLength": 1,
                  "description": "GGUF path or URL, or a folder from `tokenmill quantize`; null = the default "
                                 "SmolLM2-135M-Instruct Q4_1."},
        "columns": _obj("Which input columns hold what.", {
            "prompt": {**_NAME, "description": "Column of prompt text (default 'prompt')."},
            "messages": {**_NAME, "description": "Column of chat messages [{role, content}], used when the prompt "
                                                 "column is absent (default 'messages')."},
            "id": {**_NAME, "description": "Column of row ids; row positions when absent (default 'id')."},
            "chat_template": {"type": "boolean", "description": "Wrap text prompts in the model's chat template "
                                                                "(default true)."},
        }),
        "sampling": _obj("How to sample, per row.", {
            "max_tokens": {**_COUNT, "description": "Most output tokens per row, an integer >= 1 (default 256)."},
            "temperature": {"type": "number", "minimum": 0, "description": "0 = greedy (default); > 0 samples."},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                      "description": "Nucleus sampling mass in (0, 1] (default 1)."},
            "top_k": {"type": "integer", "minimum": 0, "description": "Keep the k likeliest tokens; 0 = off."},
            "seed": {"type": ["integer", "null"], "minimum": 0,
                     "description": "An integer >= 0 makes sampled rows reproducible; null = unseeded."},
            "stop": {"type": "array", "items": {"type": "string", "minLength": 1},
                     "description": "Stop strings, a list of non-empty strings."},
        }),
        "sharding": _obj("How the input is cut into shards and how often a shard checkpoints.", {
            "rows_per_shard": {**_COUNT, "description": "Rows per shard, the unit of scheduling, retry and "
                                                         "accounting (default 1000)."},
            "limit": {"type": ["integer", "null"], "minimum": 1,
                      "description": "Only the first N rows of the input; null = all."},
            "checkpoint_rows": {**_COUNT, "description": "Commit a checkpoint part every N finished rows "
                                                          "(default 64)."},
            "checkpoint_seconds": {"type": "number", "exclusiveMinimum": 0,
                                   "description": "... or every T seconds, whichever comes first (default 60)."},
        }),
        "cluster": _obj("Where the shards run.", {
            "scheduler": {"type": ["string", "null"], "pattern": "^(tcp|tls|ws|wss|inproc)://",
                          "description": "Dask scheduler address such as tcp://host:8786; null = an embedded "
                                         "LocalCluster."},
            "workers": {**_COUNT, "description": "Worker processes of the embedded LocalCluster (default 1)."},
            "gpus_per_worker": {"type": "integer", "minimum": 0,
                                "description": "GPUs each worker holds; > 0 makes every shard ask for "
                                               "resources {GPU: 1} (default 0)."},
        }),
        "engine": _obj("The engine's device and limits, per worker.", {
            "device": {"type": "string", "pattern": "^(auto|cpu|cuda(:[0-9]+)?)$",
                       "description": "auto, cpu, cuda or cuda:N."},
            "dtype": {"enum": ["auto", "float32", "bfloat16", "float16"],
                      "description": "auto (bf16 on cuda and on cpus with native bf16, else fp32), float32, "
                                     "bfloat16 or float16."},
            "quantization": {"enum": ["none", "auto", "int4", "int8"],
                             "description": "none (weights dequantized to dtype, the reference; default), auto "
                                            "(INT4 where the model file stores INT4), int4 (every projection INT4 "
                                            "on load), int8 (W8A8 on the CPU: int8 weights per channel, int8 "
                                            "activations per token)."},
            "max_num_seqs": {**_COUNT, "description": "Most rows decoding at once per engine (default 256)."},
            "kv_cache_gib": {"type": "number", "exclusiveMinimum": 0,
                             "description": "KV cache size on cpu, GiB per worker, > 0 (default 1)."},
            "max_model_len": {"type": ["integer", "null"], "minimum": 2,
                              "description": "Most tokens (prompt + output) per row; null = the model's context."},
        }),
        "price_per_hour": {"type": "number", "minimum": 0,
                           "description": "Device price in USD per hour, for the bill (default 2.0)."},
    }, required=("input", "output")),
}


class JobSpecError(ValueError):
    """A job spec that cannot be read or does not match JOB_SPEC_SCHEMA. The message lists every problem with its
    field path (e.g. `sampling.temperature`) and what the field accepts."""


@dataclass(frozen=True)
class JobSpec:
    """A validated job spec; defaults match `tokenmill run`'s options. Units: price_per_hour in USD/hour,
    checkpoint_seconds in seconds, kv_cache_gib in GiB."""

    input: str
    output: str
    model: str | None = None
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    id_column: str = "id"
    chat_template: bool = True
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    rows_per_shard: int = 1000
    limit: int | None = None
    checkpoint_rows: int = 64
    checkpoint_seconds: float = 60.0
    scheduler: str | None = None
    workers: int = 1
    gpus_per_worker: int = 0
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"
    max_num_seqs: int = 256
    kv_cache_gib: float = 1.0
    max_model_len: int | None = None
    price_per_hour: float = 2.0


# (section, key in the YAML) -> JobSpec field, for the nested sections.
_FIELDS = {("columns", "prompt"): "prompt_column", ("columns", "messages"): "messages_column",
           ("columns", "id"): "id_column", ("columns", "chat_template"): "chat_template",
           **{("sampling", k): k for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")},
           **{("sharding", k): k for k in ("rows_per_shard", "limit", "checkpoint_rows", "checkpoint_seconds")},
           **{("cluster", k): k for k in ("scheduler", "workers", "gpus_per_worker")},
           **{("engine", k): k for k in ("device", "dtype", "quantization", "max_num_seqs", "kv_cache_gib",
                                         "max_model_len")}}


def _describe(error: jsonschema.ValidationError) -> str:
    """One line: the field path, what is wrong, and what the field accepts."""
    path = ".".join(str(p) for p in error.absolute_path)
    where = path or "the top level"
    if error.validator == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(known))
        hints = []
        for name in extra:
            close = difflib.get_close_matches(name, known, n=1)
            full = f"{path}.{name}" if path else name
            hints.append(f"unknown field {full!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return f"{'; '.join(hints)}; the fields of {where} are: {', '.join(known)}"
    if error.validator == "required":
        missing = error.message.split("'")[1]
        full = f"{path}.{missing}" if path else missing
        doc = error.schema.get("properties", {}).get(missing, {}).get("description", "")
        return f"missing field {full!r}: {doc}".rstrip(": ")
    doc = error.schema.get("description", "")
    return f"{where}: {error.message}" + (f". Expected: {doc}" if doc else "")


def parse_job_spec(doc: Any, source: str = "job spec") -> JobSpec:
    """Validate a parsed spec (a dict, as from YAML) against JOB_SPEC_SCHEMA and build the JobSpec.

    Raises JobSpecError listing every problem, each with its field path and what the field accepts.
    """
    if not isinstance(doc, dict):
        raise JobSpecError(f"{source} must be a YAML mapping with at least `input:` and `output:`, got "
                           f"{type(doc).__name__}")
    validator = jsonschema.Draft202012Validator(JOB_SPEC_SCHEMA)
    errors = sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        lines = "\n".join(f"  - {_describe(e)}" for e in errors)
        raise JobSpecError(f"{source} is invalid ({len(errors)} problem{'s' if len(errors) > 1 else ''}):\n{lines}")
    kwargs: dict[str, Any] = {k: doc[k] for k in ("input", "output", "model", "price_per_hour") if k in doc}
    for (section, key), name in _FIELDS.items():
        if key in doc.get(section, {}):
            kwargs[name] = doc[section][key]
    if "stop" in kwargs:
        kwargs["stop"] = tuple(kwargs["stop"])
    for name in ("temperature", "top_p", "checkpoint_seconds", "kv_cache_gib", "price_per_hour"):
        if name in kwargs:
            kwargs[name] = float(kwargs[name])
    return JobSpec(**kwargs)


def load_job_spec(path: str) -> JobSpec:
    """Read a YAML job spec from `path` (a local path or fsspec URL) and validate it (parse_job_spec).

    Raises JobSpecError when the file is missing, is not YAML, or does not match the schema.
    """
    try:
        with fsspec.open(path, "rt") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError as e:
        raise JobSpecError(f"job spec {path!r} not found") from e
    except yaml.YAMLError as e:
        raise JobSpecError(f"job spec {path!r} is not valid YAML: {e}") from e
    return parse_job_spec(doc, f"job spec {path!r}")
