"""The job spec: the example in infra/ loads, bad specs fail with the field's path and what it accepts."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest

from schemas import JOB_SPEC_SCHEMA, JobSpec, JobSpecError, load_job_spec, parse_job_spec

EXAMPLE = Path(__file__).resolve().parents[2] / "infra" / "job.example.yaml"


def test_example_spec_loads_with_its_values() -> None:
    jsonschema.Draft202012Validator.check_schema(JOB_SPEC_SCHEMA)
    spec = load_job_spec(str(EXAMPLE))
    assert spec.input.endswith("gsm8k_test.parquet") and spec.output == "out/gsm8k-example"
    assert (spec.prompt_column, spec.max_tokens, spec.rows_per_shard, spec.limit) == ("question", 128, 32, 64)
    assert (spec.checkpoint_rows, spec.checkpoint_seconds, spec.gpus_per_worker) == (64, 60.0, 0)
    assert isinstance(spec.checkpoint_seconds, float) and spec.stop == () and spec.scheduler is None


def test_minimal_spec_takes_the_run_defaults() -> None:
    spec = parse_job_spec({"input": "s3://b/in/", "output": "s3://b/out/", "sampling": {"stop": ["\n\n"]}})
    assert spec == JobSpec(input="s3://b/in/", output="s3://b/out/", stop=("\n\n",))
    assert spec.quantization == "none"
    int8 = parse_job_spec({"input": "a", "output": "b", "engine": {"quantization": "int8", "dtype": "float32"}})
    assert (int8.quantization, int8.dtype) == ("int8", "float32")


@pytest.mark.parametrize(("doc", "expected"), [
    ({"input": "a"}, ["missing field 'output'"]),
    ({"input": "a", "output": "b", "sampling": {"temprature": 0.5}},
     ["unknown field 'sampling.temprature' (did you mean 'temperature'?)"]),
    ({"input": "a", "output": "b", "sampling": {"top_p": 1.5, "max_tokens": 0}},
     ["sampling.max_tokens: 0 is less than the minimum of 1", "sampling.top_p: 1.5 is greater than the maximum of 1",
      "Nucleus sampling mass in (0, 1]"]),
    ({"input": "a", "output": "b", "engine": {"device": "gpu", "dtype": "fp8"}},
     ["engine.device: 'gpu' does not match", "auto, cpu, cuda or cuda:N", "engine.dtype: 'fp8' is not one of"]),
    ({"input": "a", "output": "b", "engine": {"quantization": "int3"}},
     ["engine.quantization: 'int3' is not one of ['none', 'auto', 'int4', 'int8']", "W8A8 on the CPU"]),
    ({"input": "a", "output": "b", "cluster": {"scheduler": "dask:8786", "gpus_per_worker": -1}},
     ["cluster.gpus_per_worker: -1 is less than the minimum of 0", "cluster.scheduler: 'dask:8786' does not match",
      "tcp://host:8786"]),
    ({"input": "a", "output": "b", "sharding": {"rows_per_shard": "100"}},
     ["sharding.rows_per_shard: '100' is not of type 'integer'"]),
    ({"input": "a", "output": "b", "max_tokens": 10}, ["unknown field 'max_tokens'", "sampling"]),
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
