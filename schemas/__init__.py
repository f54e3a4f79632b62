"""Arrow schemas of tokenmill's inputs and outputs, and the job spec (one typed model of every job option).

NOTE: the Arrow schemas load on first use (PEP 562): the CLI reads the job spec without importing pyarrow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas.job_spec import JobSpec, JobSpecError, job_spec_json_schema, load_job_spec, parse_job_spec

if TYPE_CHECKING:
    from schemas.arrow import ACCOUNTING_SCHEMA, RESULTS_SCHEMA

__all__ = ["ACCOUNTING_SCHEMA", "RESULTS_SCHEMA", "JobSpec", "JobSpecError", "job_spec_json_schema", "load_job_spec",
           "parse_job_spec"]


def __getattr__(name: str) -> Any:
    """ACCOUNTING_SCHEMA and RESULTS_SCHEMA from schemas.arrow on first use; AttributeError for any other name."""
    if name in ("ACCOUNTING_SCHEMA", "RESULTS_SCHEMA"):
        from schemas import arrow

        return getattr(arrow, name)
    raise AttributeError(f"module 'schemas' has no attribute {name!r}")
