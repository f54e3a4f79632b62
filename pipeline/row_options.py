"""Per-row sampling and per-row request errors carried by the input itself.

An input file may hold, beside its prompt and id columns:

- sampling columns named as the sampling fields (ROW_SAMPLING_COLUMNS = schemas.sampling.SAMPLING_FIELDS:
  max_tokens, temperature, top_p, top_k, seed, n, logprobs, presence_penalty, frequency_penalty, repetition_penalty,
  min_tokens, stop, logit_bias, and the structured output json_schema, json_object, regex, choices). A row's
  non-null value wins over the job's default (RunConfig); a row's own seed is used as is (the job's seed is mixed
  with the row id, see RunConfig). A row that sets any structured output field replaces the job's constraint with
  its own. logit_bias is a map<int, float> column or JSON text {"token id": bias};
- a `request_error` column (ROW_ERROR_COLUMN): text that makes the row an error row with that message, without
  running it. Converters fill it for requests they cannot map (jobs.formats.openai_batch: a malformed JSONL line).

A row whose own values are out of range (max_tokens 0, temperature -1) becomes an error row naming the value, not a
failed shard: they go through engine.SamplingParams, the same validation (schemas.sampling's ranges) as the job's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from engine import SamplingParams, StructuredOutputsParams
from schemas.sampling import SAMPLING_FIELDS, STRUCTURED_FIELDS

ROW_SAMPLING_COLUMNS = SAMPLING_FIELDS
ROW_ERROR_COLUMN = "request_error"


def row_option_columns(names: Iterable[str]) -> list[str]:
    """The per-row option columns (sampling and request_error) among a file's column `names`, in a fixed order."""
    present = set(names)
    return [c for c in (*ROW_SAMPLING_COLUMNS, ROW_ERROR_COLUMN) if c in present]


def row_overrides(columns: dict[str, list[Any]], num_rows: int) -> list[dict[str, Any]] | None:
    """Per row, the non-null sampling values of the columns read ({name: values}); None when there are none."""
    sampling = [c for c in ROW_SAMPLING_COLUMNS if c in columns]
    if not sampling:
        return None
    return [{c: columns[c][k] for c in sampling if columns[c][k] is not None} for k in range(num_rows)]


def row_sampling_params(default: SamplingParams, overrides: dict[str, Any] | None) -> SamplingParams:
    """`default` with a row's own sampling values put in. Raises ValueError (naming the field and the allowed range)
    when a row's value is out of range or of the wrong type."""
    if not overrides:
        return default
    values = {k: v for k, v in overrides.items() if k not in STRUCTURED_FIELDS}
    if "stop" in values:
        values["stop"] = (values["stop"],) if isinstance(values["stop"], str) else tuple(values["stop"])
    try:
        structured = {k: v for k, v in overrides.items() if k in STRUCTURED_FIELDS}
        if structured:
            values["structured_outputs"] = StructuredOutputsParams.from_fields(**structured)
        return dataclasses.replace(default, **values)
    except TypeError as e:  # a list where a number belongs, say
        raise ValueError(f"a per-row sampling value has the wrong type ({overrides}): {e}") from e
