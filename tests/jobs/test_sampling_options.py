"""The sampling options of a job (schemas.sampling's one set of rules): `tokenmill run` options and spec fields
for structured outputs, logprobs, n and penalties reach RunConfig and SamplingParams; the spec, per-row values and
SamplingParams refuse the same values with the same range."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine import SamplingParams
from jobs.cli import app
from jobs.errors import JobError
from jobs.spec import run_config
from pipeline.row_options import row_sampling_params
from schemas.job_spec import JobSpec, JobSpecError
from schemas.sampling import SAMPLING_RANGES


def test_run_options_for_structured_outputs_logprobs_n_and_penalties(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    path = tmp_path / "answer.schema.json"
    path.write_text(json.dumps(schema))
    spec = JobSpec.from_options(input="in.parquet", output="out", json_schema=str(path), logprobs=4, n=2,
                                presence_penalty=0.5, repetition_penalty=1.1)
    sp = run_config(spec).sampling_params(row_seed=3)
    assert json.loads(sp.structured_outputs.json_schema) == schema  # the file's content, not its path
    assert (sp.logprobs, sp.n, sp.presence_penalty, sp.repetition_penalty) == (4, 2, 0.5, 1.1)
    assert run_config(JobSpec.from_options(input="i", output="o", min_tokens=3)).sampling_params().min_tokens == 3
    choices = run_config(JobSpec.from_options(input="i", output="o", choices=["yes", "no"])).sampling_params()
    assert choices.structured_outputs.choices == ("yes", "no")
    with pytest.raises(JobError, match="exactly one of json_schema, json_object, regex, choices"):
        run_config(JobSpec.from_options(input="i", output="o", regex="[a-z]+", choices=["a"]))
    with pytest.raises(JobError, match="cannot read the JSON Schema file"):
        run_config(JobSpec.from_options(input="i", output="o", json_schema=str(tmp_path / "missing.json")))
    # The options are on `tokenmill run`, generated from the spec.
    helptext = CliRunner().invoke(app, ["run", "--help"], terminal_width=200).stdout
    for flag in ("--json-schema", "--regex", "--choices", "--logprobs", "--n ", "--presence-penalty",
                 "--repetition-penalty", "--min-tokens"):
        assert flag in helptext


@pytest.mark.parametrize(("name", "bad"), [("top_k", -2), ("seed", -1), ("logprobs", 21), ("n", 0),
                                           ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
                                           ("top_p", 0.0), ("max_tokens", 0)])
def test_one_set_of_rules_for_the_spec_rows_and_the_engine(name: str, bad: float) -> None:
    """A value out of range is refused by the job spec, by a row's own column and by SamplingParams alike, each
    message naming the same range (schemas.sampling)."""
    rule = re.escape(SAMPLING_RANGES[name].describe())
    with pytest.raises(JobSpecError, match=f"sampling.{name}"):
        JobSpec.from_options(input="i", output="o", **{name: bad})
    with pytest.raises(ValueError, match=f"{name} must be {rule}"):
        row_sampling_params(SamplingParams(), {name: bad})
    with pytest.raises(ValueError, match=f"{name} must be {rule}"):
        SamplingParams(**{name: bad})
    # And the edge the engine accepts, the spec accepts too (top_k -1 = off, seed 0).
    edge = {"top_k": -1, "seed": 0, "logprobs": 20, "n": 1, "frequency_penalty": -2.0, "repetition_penalty": 0.5,
            "top_p": 1.0, "max_tokens": 1}[name]
    assert JobSpec.from_options(input="i", output="o", **{name: edge}).option(name) == edge
    assert getattr(SamplingParams(**{name: edge}), name) == edge
