"""The engine WorkerPlugin on a real LocalCluster: named by config, idempotent, one engine per worker, load errors
reach the task. Uses a missing model file so no weights load (the CLI tests load the real model)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster
from distributed.core import Status

from engine import EngineConfig, SamplingParams
from jobs.cluster import CLUSTER_CONFIG
from jobs.plugin import PLUGIN_PREFIX, EnginePlugin, get_engine, register_engine


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    # The config `tokenmill run` starts its LocalCluster under.
    with (dask.config.set(CLUSTER_CONFIG),
          LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                       silence_logs=logging.ERROR) as cluster,
          Client(cluster) as c):
        yield c


def test_workers_start_without_the_nannys_malloc_trim_threshold(client: Client) -> None:
    # The nanny would set MALLOC_TRIM_THRESHOLD_=65536 (glibc then mmaps every large activation tensor anew: 1.66x
    # slower on the CPU path); the cluster config unsets it and keeps the rest of the nanny's environment.
    env = client.run(lambda: (os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("OMP_NUM_THREADS")))
    assert list(env.values()) == [(None, "1")]


def _engine_plugins(dask_worker: Any) -> dict[str, int]:
    return {n: id(p) for n, p in dask_worker.plugins.items() if n.startswith(PLUGIN_PREFIX)}


def _load_error(plugin_name: str) -> str:
    try:
        get_engine(plugin_name)
    except RuntimeError as e:
        return str(e)
    return "loaded"


def test_same_config_is_registered_once_other_config_replaces_it(client: Client, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model.gguf")
    a = EnginePlugin(missing, EngineConfig(device="cpu"), torch_threads=1)
    name_a = register_engine(client, a)
    assert name_a == EnginePlugin(missing, EngineConfig(device="cpu"), torch_threads=1).name
    (before,) = client.run(_engine_plugins).values()
    assert list(before) == [name_a]

    register_engine(client, EnginePlugin(missing, EngineConfig(device="cpu"), torch_threads=1))
    (again,) = client.run(_engine_plugins).values()
    assert again == before  # idempotent: the resident plugin (and its engine) is kept, not reloaded

    name_b = register_engine(client, EnginePlugin(missing, EngineConfig(device="cpu", max_num_seqs=8),
                                                  torch_threads=1))
    (after,) = client.run(_engine_plugins).values()
    assert name_b != name_a and list(after) == [name_b]  # one engine per worker


def test_a_failed_load_reaches_the_task_with_its_cause(client: Client, tmp_path: Path) -> None:
    name = register_engine(client, EnginePlugin(str(tmp_path / "missing.gguf"), EngineConfig(device="cpu")))
    message = client.submit(_load_error, name, pure=False).result()
    assert "failed to load" in message and "missing.gguf" in message
    assert "not registered" in client.submit(_load_error, "tokenmill-engine-nope", pure=False).result()


class _Worker:
    def __init__(self, status: Status) -> None:
        self.status = status


def test_a_closing_workers_teardown_aborts_and_joins_the_engine_loop(tiny_model: str,
                                                                     gsm8k_questions: list[str]) -> None:
    """A closing worker's teardown (its process is about to exit) aborts the rows in the engine and returns once
    the loop's step thread has ended: a daemon thread still in torch while the interpreter finalizes is ended
    inside C++ ("terminate called without an active exception"). A plugin removed from a running worker (another
    job's engine registered) lets its rows finish."""
    for status, reason, max_tokens in ((Status.closing, "abort", 4000), (Status.running, "length", 6)):
        plugin = EnginePlugin(tiny_model, EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))
        plugin.setup(worker=None)
        assert plugin.loads == 0  # nothing loads until a shard has a row to run (jobs.task, pipeline.shard)
        loop = plugin.loop()
        assert plugin.get() is loop.engine and plugin.loads == 1  # loaded once, then resident
        sub = loop.submit(gsm8k_questions[:4], SamplingParams(max_tokens=max_tokens))
        deadline = time.monotonic() + 60
        while loop.engine.step_stats.num_steps < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        plugin.teardown(_Worker(status))
        if status == Status.closing:
            assert loop._thread is not None and not loop._thread.is_alive()
        assert [o.finish_reason for o in sub.results()] == [reason] * 4
        with pytest.raises(RuntimeError, match="unloaded"):
            plugin.get()
