"""Arrow schemas of tokenmill's inputs and outputs, shared by the writers and the tests."""

from schemas.arrow import ACCOUNTING_SCHEMA, RESULTS_SCHEMA

__all__ = ["ACCOUNTING_SCHEMA", "RESULTS_SCHEMA"]
