"""The jobs tests run the tiny random-weight model (tests/conftest.py `tiny_model`): they check ids, commits,
resumes, leases, signals, accounting and exit codes, not text. Every way a job reaches a model leads there: the
`engine` fixture (shards run in this process), TOKENMILL_MODEL (`tokenmill run` in process or in a child process),
and a job with no model (`run_job`, `tokenmill submit` of a spec without `model`) whose workers would load the
default (and whose client pins the default: pipeline.model_pin.default_model_path). Tests marked `slow` keep the
real model on every path (test_cli's end-to-end run)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import dask
import pytest
from distributed import LocalCluster
from held_shard import PRELOAD

import jobs.cluster
import pipeline.model_pin
from engine import LLMEngine


@pytest.fixture(scope="session")
def engine(tiny_engine: LLMEngine) -> LLMEngine:
    """The tiny stand-in of the real model (module docstring)."""
    return tiny_engine


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[str]:
    """A real Dask LocalCluster of one worker process, started once per test session (per xdist worker) under the
    settings `tokenmill run` starts its own with (jobs.cluster.CLUSTER_CONFIG); yields its scheduler address.

    Tests whose point is what a job writes (results against the reference engine, exports, summaries, resumes) and
    not the run's own cluster (its start and close, the dashboard line, the worker keeper, signals, the worker's
    environment) run `tokenmill run ... --scheduler ADDRESS` on it: a job then costs its rows, not a worker
    process's start-up and model load (about 7 s quiet, 15 s loaded, per run), and the worker keeps the last job's
    engine resident as a long-lived cluster's worker does (jobs.plugin.register_engine). Other tests keep
    starting their own cluster, so that path stays covered. The settings apply to the start only (the worker's
    environment and intervals), not to the rest of the session's Dask config.

    The worker loads hold_shard_preload.py, which changes nothing until a test arms it (held_shard.armed): a test
    that must stop a job on it mid-shard (a cancel) holds the shard that way; its shards poll the cancel marker
    every 0.2 s (TOKENMILL_STOP_POLL_S in the worker's environment, as the tests' own runs set it), not 5 s."""
    with dask.config.set(jobs.cluster.CLUSTER_CONFIG):
        cluster = LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address="127.0.0.1:0",
                               silence_logs=logging.ERROR, preload=[str(PRELOAD)],
                               env={"TOKENMILL_STOP_POLL_S": "0.2"})
    with cluster:
        yield cluster.scheduler_address


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
