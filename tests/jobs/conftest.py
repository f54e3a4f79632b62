"""The jobs tests run the tiny random-weight model (tests/conftest.py `tiny_model`): they check ids, commits,
resumes, leases, signals, accounting and exit codes, not text. Every way a job reaches a model leads there: the
`engine` fixture (shards run in this process), TOKENMILL_MODEL (`tokenmill run` in process or in a child process),
and a job with no model (`run_job`, `tokenmill submit` of a spec without `model`) whose workers would load the
default (and whose client pins the default: pipeline.model_pin.default_model_path). Tests marked `slow` keep the
real model on every path (test_cli's end-to-end run)."""

from __future__ import annotations

from typing import Any

import pytest

import jobs.cluster
import pipeline.model_pin
from engine import LLMEngine


@pytest.fixture(scope="session")
def engine(tiny_engine: LLMEngine) -> LLMEngine:
    """The tiny stand-in of the real model (module docstring)."""
    return tiny_engine


@pytest.fixture(autouse=True)
def _tiny_model_by_default(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point jobs without a model at the tiny one, unless the test is marked `slow` (the real model)."""
    if request.node.get_closest_marker("slow"):
        return
    tiny = request.getfixturevalue("tiny_model")
    monkeypatch.setenv("TOKENMILL_MODEL", tiny)
    plugin = jobs.cluster.EnginePlugin

    def tiny_by_default(model: str | None, *args: Any, **kwargs: Any) -> Any:
        return plugin(model if model is not None else tiny, *args, **kwargs)

    monkeypatch.setattr(jobs.cluster, "EnginePlugin", tiny_by_default)
    # The client pins the model a job without one runs: the tiny one here, as its workers load.
    monkeypatch.setattr(pipeline.model_pin, "default_model_path", lambda: tiny)
