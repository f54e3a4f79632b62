"""The engine's choices are defined once (schemas.engine_choices): engine.EngineConfig and the job spec's `engine`
section accept the same values, refuse the same others, and start from the same defaults."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from schemas import JobSpecError, parse_job_spec
from schemas.engine_choices import (
    ATTENTION_BACKENDS,
    DEFAULT_INT4_GROUP_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    DTYPES,
    INT4_GROUP_SIZES,
    QUANTIZATIONS,
    choice_problem,
)


def _spec_engine(**engine: object) -> object:
    return parse_job_spec({"input": "in/", "output": "out/", "engine": engine}).engine


@pytest.mark.parametrize(("field", "choices", "outside"), [("dtype", DTYPES, "fp8"),
                                                          ("quantization", QUANTIZATIONS, "int3")])
def test_the_spec_and_the_engine_config_take_the_same_choices(field: str, choices: tuple, outside: str) -> None:
    for value in choices:
        assert getattr(_spec_engine(**{field: value}), field) == value
        assert getattr(EngineConfig(**{field: value}), field) == value
    with pytest.raises(JobSpecError, match=f"engine.{field}"):
        _spec_engine(**{field: outside})
    with pytest.raises(ValueError, match=f"{field} must be {', '.join(choices[:-1])} or {choices[-1]}, got"):
        EngineConfig(**{field: outside})


def test_engine_only_choices_and_the_shared_defaults() -> None:
    for size in INT4_GROUP_SIZES:
        assert EngineConfig(int4_group_size=size).int4_group_size == size
    for backend in ATTENTION_BACKENDS:
        assert EngineConfig(attention_backend=backend).attention_backend == backend
    with pytest.raises(ValueError, match="int4_group_size must be 32, 64, 128 or 256, got 100"):
        EngineConfig(int4_group_size=100)
    with pytest.raises(ValueError, match="attention_backend must be auto, triton, cpu or torch, got 'flash'"):
        EngineConfig(attention_backend="flash")
    engine, spec = EngineConfig(), _spec_engine()
    assert engine.max_num_seqs == spec.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert (engine.dtype, engine.quantization) == (spec.dtype, spec.quantization) == ("auto", "none")
    assert engine.int4_group_size == DEFAULT_INT4_GROUP_SIZE


def test_a_value_of_another_type_is_no_choice() -> None:
    assert choice_problem("int4_group_size", 128, INT4_GROUP_SIZES) is None
    for value in (128.0, True, "128"):
        assert choice_problem("int4_group_size", value, INT4_GROUP_SIZES) == (
            f"int4_group_size must be 32, 64, 128 or 256, got {value!r}")
