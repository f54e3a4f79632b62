"""Per-request sampling parameters (the field's standard names, as in vLLM's `SamplingParams`). The ranges are
schemas.sampling's, the one definition the job spec, per-row columns and OpenAI batch bodies share."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.sampling import LOGIT_BIAS_RANGE, SAMPLING_RANGES


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output text, compiled to a grammar (engine.sample.structured_output, xgrammar): exactly one
    of

    Attributes:
        json_schema: a JSON Schema (JSON text): the output is one JSON value valid against it.
        json_object: True: the output is any JSON object (OpenAI's response_format {"type": "json_object"}).
        regex: the output matches this regular expression (whole match).
        choices: the output is exactly one of these strings.

    As vLLM's StructuredOutputsParams (json, json_object, regex, choice). Raises ValueError when none or more than
    one is set, when json_schema is not JSON text of an object or boolean, or when a choice or the regex is empty.
    """

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.choices is not None:
            if isinstance(self.choices, str):
                raise ValueError(f"choices must be a list of strings, got the string {self.choices!r}")
            object.__setattr__(self, "choices", tuple(self.choices))
        if isinstance(self.json_schema, Mapping):  # a parsed schema: kept as canonical text (the cache key)
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema, sort_keys=True))
        kinds = [k for k, v in (("json_schema", self.json_schema), ("json_object", self.json_object or None),
                                ("regex", self.regex), ("choices", self.choices)) if v is not None]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of json_schema, json_object, regex, choices; got {kinds or 'none'}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise ValueError(f"json_schema must be JSON text, got {type(self.json_schema).__name__}")
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"json_schema is not valid JSON ({e}); give a JSON Schema object") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"json_schema must be a JSON Schema object, got JSON {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r}")
        if self.choices is not None and (not self.choices or any(not isinstance(c, str) or not c
                                                                 for c in self.choices)):
            raise ValueError(f"choices must be a non-empty list of non-empty strings, got {list(self.choices)!r}")

    @classmethod
    def from_fields(cls, json_schema: Any = None, json_object: bool | None = None, regex: str | None = None,
                    choices: Any = None) -> StructuredOutputsParams | None:
        """The constraint of the flat fields (job spec, per-row columns; schemas.sampling.STRUCTURED_FIELDS), None
        when none is set (json_object False counts as unset). Raises ValueError as the constructor does."""
        if json_schema is None and not json_object and regex is None and choices is None:
            return None
        return cls(json_schema=json_schema, json_object=bool(json_object), regex=regex,
                   choices=None if choices is None else tuple(choices) if not isinstance(choices, str) else choices)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping (JSON keys may be text: OpenAI sends "50256"),
    pairs, or JSON text of an object. Raises ValueError for a bad id or a bias outside [-100, 100]."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"logit_bias is not JSON text of an object ({e}); give {{\"token id\": bias}}") from None
    items = value.items() if isinstance(value, Mapping) else value
    pairs: dict[int, float] = {}
    try:
        for token, bias in items:
            tid = int(token)
            if isinstance(token, (bool, float)) or str(tid) != str(token).strip():
                raise ValueError
            problem = LOGIT_BIAS_RANGE.problem(f"logit_bias[{tid}]", bias)
            if problem or tid < 0:
                raise ValueError(problem or f"logit_bias token id {tid} is negative")
            pairs[tid] = float(bias)
    except (TypeError, ValueError) as e:
        if str(e):
            raise ValueError(str(e)) from None
        raise ValueError(f"logit_bias must map token ids to biases in [-100, 100], got {value!r}") from None
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token of one request, and when to stop.

    Attributes:
        max_tokens: most output tokens to generate (tokens, >= 1). A request also stops at the model's context
            length (`finish_reason="length"` either way).
        temperature: softmax temperature; 0 means greedy (argmax), the mode used for correctness tests.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p (0 < top_p <= 1).
            Source: Holtzman et al., "The Curious Case of Neural Text Degeneration" (ICLR 2020).
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: makes this request's samples reproducible whatever else is in the batch and after preemption: the
            uniform that draws output token i is a hash of (seed, i) (engine.sample.sampler.counter_uniforms). None
            draws
            from the engine's generator. An integer >= 0.
        stop: strings that end the completion; the matched string is not part of the returned text.
        stop_token_ids: token ids that end the completion (the model's EOS is always one unless ignore_eos).
        ignore_eos: keep generating past EOS until max_tokens (for benchmarks with fixed output lengths).
        n: independent samples of the prompt (1-128); they share the prompt's KV blocks through the prefix cache.
            Sample i > 0 of a seeded request uses seed + i (vLLM's rule).
        logprobs: None: none; k in 0-20: each output token's log probability and the k most likely tokens' (top
            logprobs). They come from the model's raw logits (log_softmax before temperature, penalties, logit_bias
            and grammar masks), as vLLM v1's default `logprobs_mode="raw_logprobs"`.
        presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of each token already in the
            output, once (presence) or once per occurrence (frequency) (OpenAI's definition).
        repetition_penalty: > 0, 1 = off; the logit of a token in the prompt or the output is divided by it when
            positive and multiplied when negative (Keskar et al., CTRL, 2019; vLLM's and HF's rule).
        min_tokens: EOS and stop_token_ids are masked until this many tokens are out (vLLM's min_tokens).
        logit_bias: (token id, bias in [-100, 100]) pairs added to those logits before sampling (OpenAI's
            logit_bias); a mapping {id: bias} or JSON text is accepted and normalized.
        structured_outputs: a constraint on the output (StructuredOutputsParams), or None.

    Raises:
        ValueError: when a value is out of range; the message names the field and the allowed range
            (schemas.sampling, the one definition of the ranges).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name, rule in SAMPLING_RANGES.items():
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs"):
                continue
            problem = rule.problem(name, value)
            if problem:
                raise ValueError(problem + (" (0 = greedy)" if name == "temperature" else
                                            " (0 or -1 = off)" if name == "top_k" else ""))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty; remove the empty string from `stop`")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            if self.ignore_eos or self.min_tokens:
                raise ValueError("ignore_eos and min_tokens cannot be combined with a structured output: the grammar "
                                 "decides where the output ends; drop them")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_logits_processing(self) -> bool:
        """True when its logits need more than the sampler (engine.sample.logits_processors): logprobs, penalties,
        min_tokens, logit_bias or a structured output."""
        return (self.logprobs is not None or self.structured_outputs is not None or bool(self.logit_bias)
                or self.min_tokens > 0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
