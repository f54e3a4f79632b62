"""Keeps one engine resident per Dask worker process, stepped by one resident engine loop (engine.loop.engine_loop) that
every shard task of the worker submits its rows to: with several shard slots per worker (Dask threads, and a
fraction of the GPU resource per shard) the next shard's rows join the batch while the current shard's tail
finishes, so the batch never drains between shards. The stop plugins live in jobs.preemption_plugin."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from distributed import Client, WorkerPlugin, get_worker
from distributed.core import Status

from engine import EngineConfig
from jobs.process_env import set_omp_wait_policy
from pipeline.model_pin import ModelPin, ModelPinError, fingerprint_model
from pipeline.shard_engine import EngineFacts

if TYPE_CHECKING:  # the engine (torch) loads on the worker only: the client pickles the plugin and never computes
    from engine import LLMEngine
    from engine.loop.engine_loop import EngineLoop

PLUGIN_PREFIX = "tokenmill-engine"
# Seconds a closing worker's teardown waits for the engine loop's step in progress to end.
TEARDOWN_JOIN_S = 60.0

log = logging.getLogger(__name__)


class EnginePlugin(WorkerPlugin):
    """Loads the model once per worker and keeps it there for every shard the worker runs.

    The load (seconds to minutes) starts at the first `get()` (or `loop()`, `loaded_model()`), in the task thread
    that asks first, off the worker's event loop, so heartbeats go on; other tasks asking meanwhile wait for it. A
    worker whose shards never need it (every row an error row: pipeline.shard) never loads it; `loads` counts the
    loads (0 or 1) and each is logged. The plugin is named after what it loads (model, engine
    config, threads) and idempotent: registering the same engine again on a long-lived cluster keeps the resident
    one instead of loading it twice; `register_engine` removes engines of other configs first, so a worker never
    holds two.

    The worker fingerprints the model it loads (pipeline.model_pin.fingerprint_model: sizes and hashes, cached per
    machine, or ETags) before and after the load; a model that changed in between fails the load. `loaded_model()`
    returns that fingerprint, which jobs.task checks against the job's pin before each shard.

    Args:
        model: GGUF path or URL, or None for the default model.
        engine_config: the engine's limits, device and dtype.
        torch_threads: intra-op threads per worker (None: leave torch's default).
        pinned_fingerprint: the fingerprint the job pinned (pipeline.model_pin), part of the plugin's name: a
            long-lived worker holding an engine of the same path but other bytes loads the model again.
    """

    idempotent = True

    def __init__(self, model: str | None, engine_config: EngineConfig, torch_threads: int | None = None,
                 pinned_fingerprint: str | None = None) -> None:
        self.model = model
        self.engine_config = engine_config
        self.torch_threads = torch_threads
        self.pinned_fingerprint = pinned_fingerprint
        key = (model, engine_config, torch_threads, pinned_fingerprint)
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
        self.name = f"{PLUGIN_PREFIX}-{digest}"

    def setup(self, worker: Any) -> None:
        set_omp_wait_policy()  # before the engine (torch) loads on this worker (jobs.process_env)
        # Created here, on the worker: the plugin travels pickled and threading objects do not pickle.
        self._engine: LLMEngine | None = None
        self._loop: EngineLoop | None = None
        self._loop_lock = threading.Lock()
        self._model: ModelPin | None = None
        self._error: BaseException | None = None
        self._loaded = threading.Event()
        self._load_lock = threading.Lock()
        self._closed = False
        self.loads = 0  # engine loads started on this worker: 0 until a shard has a row to run, then 1
        self.loaded_cpu_s: float | None = None
        # An auto-sized CPU KV pool stays within the worker's memory limit too (Dask pauses a worker at 80% of it):
        # several workers on one machine each see the machine's free memory.
        self._memory_limit: int | None = getattr(getattr(worker, "memory_manager", None), "memory_limit", None)

    def teardown(self, worker: Any) -> None:
        # A closing worker (its process is about to exit): abort what is left in the engine and wait for the step
        # thread to end, so that the thread neither steps nor frees the engine while the interpreter finalizes
        # (std::terminate, "terminate called without an active exception": engine.loop.engine_loop's docstring).
        # The plugin removed from a running worker (another job's engine registered): the loop finishes its rows.
        # The references are dropped here, after the join: the weights and the KV pool are freed on this thread
        # once running tasks let go of them, never on the step thread.
        if self._loop is not None:
            closing = getattr(worker, "status", None) in (Status.closing, Status.closed, Status.failed)
            self._loop.close(timeout_s=TEARDOWN_JOIN_S if closing else 0, abort=closing)
        self._closed = True  # no load starts after this (one in progress ends on its own thread)
        self._engine, self._loop = None, None

    def _load_once(self) -> None:
        """Load the engine in this thread unless it is loaded or loading (then wait for that load)."""
        with self._load_lock:
            if self._loaded.is_set() or self._closed:
                return
            self.loads += 1
            log.info("loading the model %s on this worker (a shard has rows to run)", self.model or "(default)")
            self._load()

    def _load(self) -> None:
        from engine import LLMEngine

        try:
            if self.torch_threads:
                import torch

                torch.set_num_threads(self.torch_threads)
            before = fingerprint_model(self.model)
            config = self.engine_config
            if self._memory_limit and config.memory_limit_bytes is None:
                config = dataclasses.replace(config, memory_limit_bytes=int(self._memory_limit))
            engine = LLMEngine.from_model(self.model, config)
            after = fingerprint_model(self.model)
            if (what := before.changes(after)) is not None:
                raise ModelPinError(f"the model {after.resolved} changed while this worker loaded it ({what}); run "
                                    "the job again once nothing writes to it")
            self._engine, self._model = engine, after
            self.loaded_cpu_s = time.process_time()  # for benchmarks: the worker's CPU seconds spent after the load
        except BaseException as e:  # surfaced to every task that asks for the engine
            self._error = e
        finally:
            self._loaded.set()

    def get(self) -> LLMEngine:
        """The loaded engine (loads it at the first call; waits for a load in progress). Raises RuntimeError (chained
        to the cause) if the load failed."""
        self._load_once()
        if self._error is not None:
            raise RuntimeError(f"the engine failed to load on this worker: {self._error}") from self._error
        if self._engine is None:
            raise RuntimeError("the engine was unloaded (its plugin was removed); run the job again")
        self._set_threads()
        return self._engine

    def loop(self) -> EngineLoop:
        """The worker's resident engine loop over the loaded engine (loads it as `get` does; made and started at the
        first call, its step thread running `torch_threads`): every shard task of the worker submits to it.
        Raises RuntimeError as `get` does."""
        from engine.loop.engine_loop import EngineLoop

        engine = self.get()
        with self._loop_lock:
            if self._loop is None:
                self._loop = EngineLoop(engine, thread_init=self._set_threads)
            return self._loop.start()

    def _set_threads(self) -> None:
        if self.torch_threads:
            import torch

            # NOTE: OpenMP thread counts can be per OS thread; set it on every thread that computes, not only the
            # loader's: the engine loop's step thread, and a task's thread that calls the engine itself.
            torch.set_num_threads(self.torch_threads)

    def loaded_model(self) -> ModelPin:
        """The fingerprint of the model this worker loaded, taken at its load (loads it as `get` does). Raises
        RuntimeError as `get` does."""
        self.get()
        if self._model is None:
            raise RuntimeError("the engine was unloaded (its plugin was removed); run the job again")
        return self._model


    def facts(self, model_pin: ModelPin | None) -> EngineFacts:
        """What the rows and accounting of a shard that needs no engine say (pipeline.shard_engine.EngineFacts.planned:
        this plugin's model and config, the job's pinned fingerprint `model_pin`), found without loading it."""
        return EngineFacts.planned(self.model, self.engine_config, model_pin.fingerprint if model_pin else None)


def register_engine(client: Client, plugin: EnginePlugin) -> str:
    """Register `plugin` on every current and future worker of `client`'s cluster; return its name.

    Engines of other configs registered earlier (a previous job on the same cluster) are unregistered first so
    each worker holds one model. Registering the same config again is a no-op (the engine stays resident).
    """
    registered: list[str] = client.run_on_scheduler(_worker_plugin_names)
    for name in registered:
        if name.startswith(PLUGIN_PREFIX) and name != plugin.name:
            client.unregister_worker_plugin(name)
    client.register_plugin(plugin, name=plugin.name)
    return plugin.name


def _worker_plugin_names(dask_scheduler: Any) -> list[str]:
    return list(dask_scheduler.worker_plugins)


def engine_plugin(plugin_name: str) -> EnginePlugin:
    """The EnginePlugin `plugin_name` of the worker this task runs on. Raises RuntimeError when it is not
    registered."""
    plugin = get_worker().plugins.get(plugin_name)
    if not isinstance(plugin, EnginePlugin):
        raise RuntimeError(f"worker plugin {plugin_name!r} is not registered; call register_engine first")
    return plugin


def get_engine(plugin_name: str) -> LLMEngine:
    """The engine of the worker this task runs on. Raises RuntimeError when the plugin is not registered."""
    return engine_plugin(plugin_name).get()


def get_engine_loop(plugin_name: str) -> EngineLoop:
    """The resident engine loop of the worker this task runs on. Raises RuntimeError as `get_engine` does."""
    return engine_plugin(plugin_name).loop()


# Most shard slots per worker: shards in one engine at once.
MAX_SHARD_SLOTS = 16


def shard_slots(max_num_seqs: int, rows_per_shard: int) -> int:
    """Shard tasks a worker runs at once on its one engine: enough that, while the oldest shard's tail finishes,
    the others still hold max_num_seqs rows (ceil(max_num_seqs / rows_per_shard) + 1, at least 2), rounded up to
    a power of two (each shard asks for 1/slots of a GPU, exact in binary) and at most MAX_SHARD_SLOTS.
    Raises ValueError when an argument is < 1."""
    if max_num_seqs < 1 or rows_per_shard < 1:
        raise ValueError(f"max_num_seqs and rows_per_shard must be >= 1, got {max_num_seqs} and {rows_per_shard}")
    need = max(2, -(-max_num_seqs // rows_per_shard) + 1)
    return min(1 << (need - 1).bit_length(), MAX_SHARD_SLOTS)


def default_torch_threads(workers: int) -> int:
    """Intra-op threads per worker process so `workers` processes share this machine's cores without
    oversubscribing them (Dask's nanny sets OMP_NUM_THREADS=1 in workers, so this must be set explicitly)."""
    # The CPUs this process may run on (a container's cpuset), not the host's count.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))




# The stop plugins, named here too (jobs.cluster and tests import them with the engine plugin).
from jobs.preemption_plugin import (  # noqa: E402
    DRAIN_MARGIN_S,
    DRAIN_PLUGIN,
    NANNY_CLOSING,
    PREEMPTION_PLUGIN,
    RETIRE_GRACE_S,
    WORKER_LOGGER,
    DrainNannyPlugin,
    PreemptionPlugin,
    QuietPreemption,
    WorkerPreempted,
    drain_worker,
    get_preemption,
)

__all__ = ["DRAIN_MARGIN_S", "DRAIN_PLUGIN", "MAX_SHARD_SLOTS", "NANNY_CLOSING", "PLUGIN_PREFIX", "PREEMPTION_PLUGIN",
           "RETIRE_GRACE_S", "WORKER_LOGGER", "DrainNannyPlugin", "EnginePlugin", "PreemptionPlugin",
           "QuietPreemption", "WorkerPreempted", "default_torch_threads", "drain_worker", "engine_plugin",
           "get_engine", "get_engine_loop", "get_preemption", "register_engine", "shard_slots"]
