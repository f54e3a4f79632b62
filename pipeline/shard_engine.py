"""What a shard runs its rows on: an engine it is handed (an LLMEngine, or a worker's resident engine loop), or a
LazyEngine that loads one only when the shard has a row to run, and what the shard's rows and accounting say about
it (EngineFacts). A shard whose rows are all error rows (null, empty, a request error from the input), or whose rows
are all committed already, finishes without an engine: it holds no device, so it bills 0 device-seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.loop.clock import DeviceClock
from pipeline.accounting import quantization_label

if TYPE_CHECKING:  # torch: loaded where a shard runs (a worker), never by the client that submits shards
    from engine import EngineConfig, LLMEngine
    from engine.loop.engine_loop import EngineLoop


@dataclass(frozen=True)
class EngineFacts:
    """What a shard's rows (`model`, `model_fingerprint`) and accounting (all of them) say about its engine.

    Attributes:
        model: the model's file or folder name (LLMEngine.model_name).
        device: "cpu" or the GPU's name.
        dtype: the torch dtype the engine runs in, "auto" resolved ("float32", "bfloat16", "float16").
        quantization: EngineConfig.quantization (none, auto, int4, int8), with how an already quantized model's
            layers were loaded (pipeline.accounting.quantization_label).
        model_fingerprint: the model's fingerprint (pipeline.model_pin); None when the job pinned none.
    """

    model: str
    device: str
    dtype: str
    quantization: str
    model_fingerprint: str | None = None

    @classmethod
    def of(cls, engine: LLMEngine, model_fingerprint: str | None) -> EngineFacts:
        """The facts of a loaded engine, with the fingerprint of the model it loaded."""
        return cls(engine.model_name, engine.device_name, str(engine.dtype).removeprefix("torch."),
                   quantization_label(engine.config.quantization, getattr(engine, "quantization_loaded", None)),
                   model_fingerprint)

    @classmethod
    def planned(cls, model: str | None, config: EngineConfig, model_fingerprint: str | None) -> EngineFacts:
        """The facts of the engine `LLMEngine.from_model(model, config)` would load, found without loading it: the
        model's name (engine.loading.open_model.model_name), the device and dtype `config` resolves to here, its
        quantization. `model_fingerprint`: the job's pinned model's (None: none pinned). Raises what model_name
        and resolve_device raise (FileNotFoundError for a local model that is not there, ValueError for CUDA
        asked for where there is none)."""
        from engine.loading.open_model import model_name
        from engine.worker.device import device_name, resolve_device, resolve_dtype

        device = resolve_device(config.device)
        return cls(model_name(model), device_name(device),
                   str(resolve_dtype(config.dtype, device)).removeprefix("torch."), config.quantization,
                   model_fingerprint)


@dataclass(frozen=True)
class LazyEngine:
    """An engine a shard loads only when it has a row to run (jobs.task: the worker's resident engine loop).

    Attributes:
        load: returns the engine (or engine loop) and the fingerprint of the model it loaded (None: no pin), after
            any checks (jobs.task checks it against the job's pin: ModelChanged); it may take minutes the first
            time and raises what the load raises.
        facts: what the rows and accounting of a shard that never calls `load` say (EngineFacts.planned; called
            only by such a shard).
    """

    load: Callable[[], tuple[LLMEngine | EngineLoop, str | None]]
    facts: Callable[[], EngineFacts]


class NoDeviceClock(DeviceClock):
    """The device clock of a shard attempt that holds no engine (its rows are all error rows or all committed
    already): it bills 0 device-seconds."""

    def __init__(self) -> None:
        super().__init__(None)

    def device_s(self) -> float:
        """0.0: no device was held."""
        return 0.0

    def close(self) -> float:
        """0.0: no device was held."""
        return 0.0
