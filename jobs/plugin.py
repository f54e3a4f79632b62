"""Keeps one engine resident per Dask worker process."""

from __future__ import annotations

import os
import threading
from typing import Any

from distributed import WorkerPlugin, get_worker

from engine import EngineConfig, LLMEngine

PLUGIN_NAME = "tokenmill-engine"


class EnginePlugin(WorkerPlugin):
    """Loads the model once per worker and keeps it there for every shard the worker runs.

    The load (seconds to minutes) starts in a background thread at `setup`, off the worker's event loop, so
    heartbeats go on; `get_engine()` from a task waits for it. Registered by name: registering it again (a rerun, a
    second client) replaces rather than duplicates it.

    Args:
        model: GGUF path or URL, or None for the default model.
        engine_config: the engine's limits, device and dtype.
        torch_threads: intra-op threads per worker (None: cores / workers on this machine).
    """

    name = PLUGIN_NAME

    def __init__(self, model: str | None, engine_config: EngineConfig, torch_threads: int | None = None) -> None:
        self.model = model
        self.engine_config = engine_config
        self.torch_threads = torch_threads

    def setup(self, worker: Any) -> None:
        # Created here, on the worker: the plugin travels pickled and threading objects do not pickle.
        self._engine: LLMEngine | None = None
        self._error: BaseException | None = None
        self._loaded = threading.Event()
        threading.Thread(target=self._load, name="tokenmill-engine-load", daemon=True).start()

    def _load(self) -> None:
        try:
            import torch

            if self.torch_threads:
                torch.set_num_threads(self.torch_threads)
            self._engine = LLMEngine.from_model(self.model, self.engine_config)
        except BaseException as e:  # noqa: BLE001 - surfaced to every task that asks for the engine
            self._error = e
        finally:
            self._loaded.set()

    def get(self) -> LLMEngine:
        """The loaded engine (waits for the load). Raises the load's exception if it failed."""
        self._loaded.wait()
        if self._error is not None:
            raise RuntimeError(f"the engine failed to load on this worker: {self._error}") from self._error
        if self._engine is None:
            raise RuntimeError("the engine is not loaded")
        return self._engine


def get_engine() -> LLMEngine:
    """The engine of the worker this task runs on. Raises RuntimeError when the plugin is not registered."""
    plugin = get_worker().plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, EnginePlugin):
        raise RuntimeError(f"worker plugin {PLUGIN_NAME!r} is not registered; call client.register_plugin first")
    return plugin.get()


def default_torch_threads(workers: int) -> int:
    """Intra-op threads per worker process so `workers` processes share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))
