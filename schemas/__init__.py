"""Arrow schemas of tokenmill's inputs and outputs, and the job spec's JSON Schema, shared by writers and tests."""

from schemas.arrow import ACCOUNTING_SCHEMA, RESULTS_SCHEMA
from schemas.job_spec import JOB_SPEC_SCHEMA, JobSpec, JobSpecError, load_job_spec, parse_job_spec

__all__ = ["ACCOUNTING_SCHEMA", "JOB_SPEC_SCHEMA", "RESULTS_SCHEMA", "JobSpec", "JobSpecError", "load_job_spec",
           "parse_job_spec"]
