"""The sampling fields of a request, defined once: their names, ranges and meaning.

engine.SamplingParams validates against these rules, the job spec's `sampling` section (schemas.job_spec) takes its
field constraints from them, and per-row columns (pipeline.row_options) and OpenAI batch bodies
(jobs.formats.openai_batch) are named after them and validated through SamplingParams, so a value is accepted or
refused with the same message wherever it is written. Plain Python (no torch): schemas is the bottom layer, imported
by every other package.

Ranges follow OpenAI's chat completions API and vLLM's SamplingParams (vllm/sampling_params.py): penalties in
[-2, 2], logit_bias in [-100, 100], top_logprobs 0-20 (OpenAI), repetition_penalty > 0 with 1 = off and top_k 0 or
-1 = off (vLLM). A seed is an integer >= 0 (below 2^63).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """The allowed range of one numeric sampling field: ge/gt/le/lt bounds (None: unbounded), and whether it is an
    integer field."""

    integer: bool
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def describe(self) -> str:
        """The range in words, e.g. 'a number in (0, 1]' or 'an integer >= 1'."""
        kind = "an integer" if self.integer else "a number"
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            return f"{kind} in {low}, {high}"
        if low:
            return f"{kind} {'>=' if low[0] == '[' else '>'} {low[1:]}"
        if high:
            return f"{kind} {'<=' if high[-1] == ']' else '<'} {high[:-1]}"
        return kind

    def problem(self, name: str, value: Any) -> str | None:
        """What is wrong with `value` for the field `name`, as one line naming the allowed range; None when fine.
        Booleans are refused where numbers belong, non-integers where integers do, and NaN."""
        ok_type = isinstance(value, int) if self.integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type or (isinstance(value, float) and math.isnan(value)):
            return f"{name} must be {self.describe()}, got {value!r}"
        if ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)):
            return f"{name} must be {self.describe()}, got {value!r}"
        return None

    def field_kwargs(self) -> dict[str, float]:
        """The bounds as pydantic Field keyword arguments (ge=..., le=...)."""
        return {k: getattr(self, k) for k in ("ge", "gt", "le", "lt") if getattr(self, k) is not None}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else str(x)


# The numeric sampling fields and their ranges (engine.SamplingParams holds one attribute per name).
SAMPLING_RANGES: dict[str, Range] = {
    "max_tokens": Range(integer=True, ge=1),
    "temperature": Range(integer=False, ge=0),
    "top_p": Range(integer=False, gt=0, le=1),
    "top_k": Range(integer=True, ge=-1),
    "seed": Range(integer=True, ge=0, lt=2**63),
    "n": Range(integer=True, ge=1, le=128),
    "logprobs": Range(integer=True, ge=0, le=20),
    "presence_penalty": Range(integer=False, ge=-2, le=2),
    "frequency_penalty": Range(integer=False, ge=-2, le=2),
    "repetition_penalty": Range(integer=False, gt=0, le=10),
    "min_tokens": Range(integer=True, ge=0),
}
LOGIT_BIAS_RANGE = Range(integer=False, ge=-100, le=100)  # each bias of logit_bias, added to the token's logit

# Every per-request sampling field, in the order per-row columns are read: the numeric ones, stop strings, the
# token-id logit bias, and the structured output fields (at most one of json_schema, json_object, regex, choices).
STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "choices")
SAMPLING_FIELDS = (*SAMPLING_RANGES, "stop", "logit_bias", *STRUCTURED_FIELDS)
