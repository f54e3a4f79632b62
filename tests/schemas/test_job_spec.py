"""The job spec: the example in infra/ loads, bad specs fail with the field's path and what it accepts, and the
published JSON Schema is the one the model generates."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from pipeline.config import InputError, RunConfig
from schemas import JobSpec, JobSpecError, job_spec_json_schema, load_job_spec, parse_job_spec
from schemas.job_spec import OPTIONS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "infra" / "job.example.yaml"
PUBLISHED = ROOT / "schemas" / "job_spec.schema.json"


def test_example_spec_loads_with_its_values() -> None:
    spec = load_job_spec(str(EXAMPLE))
    assert spec.input.endswith("gsm8k_test.parquet") and spec.output == "out/gsm8k-example"
    assert (spec.columns.prompt, spec.sampling.max_tokens, spec.sharding.rows_per_shard,
            spec.sharding.limit) == ("question", 128, 32, 64)
    assert (spec.sharding.checkpoint_rows, spec.sharding.checkpoint_seconds, spec.cluster.gpus_per_worker) == (64,
                                                                                                              60.0, 0)
    assert isinstance(spec.sharding.checkpoint_seconds, float) and spec.sampling.stop == ()
    assert spec.cluster.scheduler is None


def test_published_json_schema_is_generated_from_the_model_and_checks_specs() -> None:
    """schemas/job_spec.schema.json (for editors and infra) is what the model generates (regenerate it with
    `tokenmill job-schema > schemas/job_spec.schema.json`); as a plain JSON Schema it accepts the example spec
    and rejects what the model rejects."""
    schema = job_spec_json_schema()
    assert json.loads(PUBLISHED.read_text()) == schema, "regenerate schemas/job_spec.schema.json"
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors(yaml.safe_load(EXAMPLE.read_text())))
    for bad in ({"input": "a"}, {"input": "a", "output": "b", "sampling": {"top_p": 1.5}},
                {"input": "a", "output": "b", "engine": {"quantization": "int3"}},
                {"input": "a", "output": "b", "cluster": {"scheduler": "dask:8786"}},
                {"input": "a", "output": "b", "sampling": {"temprature": 0.5}}):
        assert list(validator.iter_errors(bad)), bad
        with pytest.raises(JobSpecError):
            parse_job_spec(bad)


def test_minimal_spec_takes_the_run_defaults() -> None:
    spec = parse_job_spec({"input": "s3://b/in/", "output": "s3://b/out/", "sampling": {"stop": ["\n\n"]}})
    assert spec == JobSpec.from_options(input="s3://b/in/", output="s3://b/out/", stop=("\n\n",))
    assert spec.engine.quantization == "none" and spec.option("stop") == ("\n\n",)
    int8 = parse_job_spec({"input": "a", "output": "b", "engine": {"quantization": "int8", "dtype": "float32"}})
    assert (int8.engine.quantization, int8.engine.dtype) == ("int8", "float32")
    assert int8.replace(max_tokens=9).sampling.max_tokens == 9 and int8.replace(max_tokens=9).engine == int8.engine
    with pytest.raises(JobSpecError, match=r"sampling.max_tokens \(--max-tokens\)"):
        int8.replace(max_tokens=0)
    with pytest.raises(TypeError, match="not a job option"):
        JobSpec.from_options(input="a", output="b", max_token=9)


def test_every_field_is_one_flat_option_with_the_run_defaults() -> None:
    """One option per leaf field; the pipeline's RunConfig takes its defaults from the model."""
    assert len(OPTIONS) == 49 and OPTIONS["prompt_column"].path == ("columns", "prompt")
    assert OPTIONS["dimensions"].path == ("embedding", "dimensions") and OPTIONS["truncate"].field.default is True
    assert OPTIONS["task"].path == ("task",) and JobSpec(input="a", output="b").task == RunConfig().task == "generate"
    assert {o.flag for o in OPTIONS.values()} >= {"--max-tokens", "--kv-cache-gib", "--chat-template",
                                                  "--allow-special-tokens"}
    cfg = RunConfig()
    spec = JobSpec(input="a", output="b")
    assert (cfg.max_tokens, cfg.rows_per_shard, cfg.prompt_column, cfg.price_per_hour_usd,
            cfg.allow_special_tokens) == (spec.sampling.max_tokens, spec.sharding.rows_per_shard, spec.columns.prompt,
                                          spec.price_per_hour, spec.columns.allow_special_tokens) == (
        256, 1000, "prompt", 2.0, False)
    with pytest.raises(InputError, match=r"sampling.top_p \(--top-p\): Input should be greater than 0"):
        RunConfig(top_p=0.0)
    with pytest.raises(InputError, match="apply to task embed only"):
        RunConfig(prefix="query: ")
    with pytest.raises(InputError, match=r"embedding.dimensions \(--dimensions\): Input should be greater"):
        RunConfig(task="embed", embedding_dim=384, dimensions=0)


@pytest.mark.parametrize(("doc", "expected"), [
    ({"input": "a"}, ["missing field 'output'"]),
    ({"input": "a", "output": "b", "sampling": {"temprature": 0.5}},
     ["unknown field 'sampling.temprature' (did you mean 'temperature'?)"]),
    ({"input": "a", "output": "b", "sampling": {"device": "cpu"}},
     ["unknown field 'sampling.device' (did you mean 'engine.device'?)"]),
    ({"input": "a", "output": "b", "sampling": {"top_p": 1.5, "max_tokens": 0}},
     ["sampling.max_tokens (--max-tokens): Input should be greater than or equal to 1, got 0",
      "sampling.top_p (--top-p): Input should be less than or equal to 1, got 1.5", "Nucleus sampling mass in (0, 1]"]),
    ({"input": "a", "output": "b", "engine": {"device": "gpu", "dtype": "fp8"}},
     ["engine.device (--device): String should match pattern", "auto, cpu, cuda or cuda:N",
      "engine.dtype (--dtype): Input should be 'auto', 'float32', 'bfloat16' or 'float16', got 'fp8'"]),
    ({"input": "a", "output": "b", "engine": {"quantization": "int3"}},
     ["engine.quantization (--quantization): Input should be 'none', 'auto', 'int4' or 'int8', got 'int3'",
      "W8A8 on the CPU"]),
    ({"input": "a", "output": "b", "cluster": {"scheduler": "dask:8786", "gpus_per_worker": -1}},
     ["cluster.gpus_per_worker (--gpus-per-worker): Input should be greater than or equal to 0, got -1",
      "cluster.scheduler (--scheduler): String should match pattern", "tcp://host:8786"]),
    ({"input": "a", "output": "b", "sharding": {"rows_per_shard": "100", "limit": 0}},
     ["sharding.rows_per_shard (--rows-per-shard): Input should be a valid integer, got '100'",
      "sharding.limit (--limit): Input should be greater than or equal to 1, got 0"]),
    ({"input": "a", "output": "b", "max_tokens": 10},
     ["unknown field 'max_tokens' (did you mean 'sampling.max_tokens'?)"]),
    ({"input": "a", "output": "b", "sampling": 5}, ["sampling: Input should be a valid dictionary", "How to sample"]),
])
def test_bad_specs_name_the_field_and_the_fix(doc: dict, expected: list[str]) -> None:
    with pytest.raises(JobSpecError) as e:
        parse_job_spec(doc)
    for text in expected:
        assert text in str(e.value)


def test_unreadable_spec_files(tmp_path: Path) -> None:
    with pytest.raises(JobSpecError, match="not found"):
        load_job_spec(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("input: [unclosed\n")
    with pytest.raises(JobSpecError, match="not valid YAML"):
        load_job_spec(str(tmp_path / "bad.yaml"))
    (tmp_path / "list.yaml").write_text("- input: a\n")
    with pytest.raises(JobSpecError, match="must be a YAML mapping"):
        load_job_spec(str(tmp_path / "list.yaml"))
