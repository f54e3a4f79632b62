"""What a shard runs its rows on: an engine it is handed (an LLMEngine, or a worker's resident engine loop: one
ShardRunner either way, the only place that tells them apart), or a LazyEngine that loads one only when the shard has
a row to run, and what the shard's rows and accounting say about it (EngineFacts). A shard whose rows are all error
rows (null, empty, a request error from the input), or whose rows are all committed already, finishes without an
engine (unless it was handed one loaded: LazyEngine.ready): it holds no device, so it bills 0 device-seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.loop.clock import DeviceClock
from pipeline.accounting import quantization_label

if TYPE_CHECKING:  # torch: loaded where a shard runs (a worker), never by the client that submits shards
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loop.engine_loop import EngineLoop
    from engine.outputs import RequestOutput
    from pipeline.config import RunConfig


@dataclass(frozen=True)
class ShardRunner:
    """The engine a shard's rows run on, whatever the caller handed: an LLMEngine this shard steps alone (`loop`
    None), or a worker's resident engine loop (engine.loop.engine_loop.EngineLoop) whose batch other shards' rows
    share and whose engine this thread calls directly for work without steps (embed, classify, score).

    Attributes:
        engine: the LLMEngine (its tokenizer, model config, image processor, embed / classify / score).
        loop: the engine loop that steps `engine`, or None.
    """

    engine: LLMEngine
    loop: EngineLoop | None = None

    @classmethod
    def of(cls, runner: LLMEngine | EngineLoop | ShardRunner | None) -> ShardRunner | None:
        """The runner of an LLMEngine or an EngineLoop (a ShardRunner or None as it is)."""
        from engine.loop.engine_loop import EngineLoop

        if runner is None or isinstance(runner, ShardRunner):
            return runner
        return cls(runner.engine, runner) if isinstance(runner, EngineLoop) else cls(runner)

    @property
    def idle(self) -> object | None:
        """The loop's idle share for the shard's DeviceClock (engine.loop.clock.IdleShare); None on an engine
        stepped alone (its wall time is the shard's)."""
        return None if self.loop is None else self.loop.idle

    def generate(self, prompts: list[object], params: list[SamplingParams], request_ids: list[str], cfg: RunConfig,
                 on_output: Callable[[int, RequestOutput], None], should_stop: Callable[[], bool] | None,
                 clock: DeviceClock | None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, with the job's chat-template and special-token options;
        `on_output(j, out)` for prompt j as it finishes, in this thread: submitted to the loop (its batch shared,
        `clock` billed this shard's share of its steps) or as one LLMEngine.generate call. Raises what on_output
        raises (the loop stops this shard's rows first; the engine drops the rest of its batch)."""
        options = dict(request_ids=request_ids, use_chat_template=cfg.use_chat_template,
                       allow_special_tokens=cfg.allow_special_tokens, should_stop=should_stop)
        if self.loop is not None:
            return self.loop.submit(prompts, params, clock=clock, **options).run(on_output)
        index = {rid: j for j, rid in enumerate(request_ids)}
        return self.engine.generate(prompts, params, on_output=lambda out: on_output(index[out.request_id], out),
                                    **options)


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
        loaded: the engine is loaded already (`ready`): the shard holds it, and bills its time, whatever its rows.
    """

    load: Callable[[], tuple[LLMEngine | EngineLoop, str | None]]
    facts: Callable[[], EngineFacts]
    loaded: bool = False

    @classmethod
    def ready(cls, engine: LLMEngine | EngineLoop, model_fingerprint: str | None) -> LazyEngine:
        """An engine loaded already, as a LazyEngine: `load` returns it with `model_fingerprint` (the caller checked
        it against the job's pin; None: none pinned), `facts` its EngineFacts."""
        runner = ShardRunner.of(engine)
        return cls(lambda: (engine, model_fingerprint), lambda: EngineFacts.of(runner.engine, model_fingerprint),
                   loaded=True)


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
