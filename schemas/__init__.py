"""Arrow schemas of tokenmill's inputs and outputs, and the job spec (one typed model of every job option)."""

from schemas.arrow import ACCOUNTING_SCHEMA, RESULTS_SCHEMA
from schemas.job_spec import JobSpec, JobSpecError, job_spec_json_schema, load_job_spec, parse_job_spec

__all__ = ["ACCOUNTING_SCHEMA", "RESULTS_SCHEMA", "JobSpec", "JobSpecError", "job_spec_json_schema", "load_job_spec",
           "parse_job_spec"]
