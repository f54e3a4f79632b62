"""The Dask task of a job: one shard on the worker's resident engine loop (jobs.plugin; other shard tasks of the
worker share its batch), with the worker's stop signal,
progress events for the client, and the checks that the shard's input file is still the pinned version and that the
model the worker loaded is the job's pinned model (pipeline.model_pin).
Runs on the worker; jobs.cluster submits it and gathers what it returns or raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed import get_worker

from jobs.plugin import WorkerPreempted, engine_plugin, get_preemption
from pipeline.config import RunConfig
from pipeline.denied import AccessDenied
from pipeline.input import InputChanged, Shard
from pipeline.manifest import InputFile
from pipeline.model_pin import ModelChanged, ModelPin, check_model_pin
from pipeline.record import ShardRecord
from pipeline.shard import ShardError, ShardInterrupted, run_shard
from pipeline.shard_engine import LazyEngine
from pipeline.storage import NoSpaceLeft

if TYPE_CHECKING:  # torch: the task runs on the worker, whose plugin loads the engine; the client only submits it
    from engine.loop.engine_loop import EngineLoop

PROGRESS_TOPIC = "tokenmill-progress"
PROGRESS_INTERVAL_S = 0.5
RETIRE_WAIT_S = 120.0  # how long a task that lands on a stopping worker waits for it to be taken out, seconds


@dataclass(frozen=True)
class ShardFailed:
    """What shard_task returns for a shard whose input is the problem (unreadable, or changed since it was pinned),
    or whose OUTPUT device is full (`no_space`: the job stops, pipeline.storage.NoSpaceLeft): `error` names the
    file and the fix. Returned, not raised, so the worker does not log a "Compute Failed" traceback for a failure
    the client reports in words (jobs.cluster)."""

    error: str
    no_space: bool = False


@dataclass(frozen=True)
class ShardStopped:
    """What shard_task returns for a shard a cancel (OUTPUT/_CANCEL) stopped after committing its finished rows:
    `error` is the ShardInterrupted that says how far it got. A cancel is an outcome the client records
    (jobs.cluster), not a task error: returned rather than raised, the worker logs no "Compute Failed" traceback for
    every plain cancel. WorkerPreempted (the worker itself is going away) is still raised: an error reaches the
    scheduler with the task's end, a returned value would be lost with the worker; PreemptionPlugin filters its
    "Compute Failed" record instead."""

    error: ShardInterrupted


def record_failure(output_url: str, shard_id: str, error: str) -> int:
    """Record a failed attempt of the shard that never ran (so `tokenmill status` shows it failed, with `error`);
    returns its attempt number."""
    return ShardRecord.open(output_url, shard_id).record_failure(error)


def shard_task(shard: Shard, prompt_column: str, output_url: str, cfg: RunConfig, plugin_name: str,
               run_id: str, pinned: InputFile | None = None,
               model_pin: ModelPin | None = None) -> dict[str, Any] | ShardFailed | ShardStopped:
    """Dask task: one shard on this worker's resident engine (the plugin `plugin_name`).

    Returns the shard's accounting row; ShardFailed when its input or model is the problem: the file is no longer
    the pinned version (`pinned`, checked first and again as the rows are read: exactly the pinned version is read),
    the model this worker loaded is not the job's pinned one (`model_pin`; checked against the fingerprint taken when
    the worker loaded it, before any row runs), in both cases with a failed attempt recorded, or the file cannot be
    read (run_shard's ShardError), or OUTPUT's device is full, or the store refused a write (AccessDenied: the
    object, the operation and the credential); ShardStopped when a cancel stopped it (its finished
    rows committed). Rows carry the loaded model's fingerprint. A shard with no row to run (every row an error row:
    null, empty, a request error) never loads the engine: its rows and accounting name the model the worker would
    load, with the pin's fingerprint, and it bills 0 device-seconds (pipeline.shard_engine). Raises what
    _run_shard_task raises otherwise (WorkerPreempted when its worker's stop signal stopped it; an engine that
    failed to load: RuntimeError).
    """
    try:
        if pinned is not None and (error := pinned.changed()) is not None:
            record_failure(output_url, shard.shard_id, error)
            return ShardFailed(f"InputChanged: {error}")
        version = None if pinned is None or pinned.removed else (pinned.size, pinned.version)
        return _run_shard_task(shard, prompt_column, output_url, cfg, plugin_name, run_id, version, model_pin)
    except ShardError as e:
        return ShardFailed(f"ShardError: {e}")
    except InputChanged as e:
        return ShardFailed(f"InputChanged: {e}")
    except NoSpaceLeft as e:
        return ShardFailed(str(e), no_space=True)
    except AccessDenied as e:  # the user's permission, not a bug: the line names the object (no worker traceback)
        return ShardFailed(str(e))
    except ShardInterrupted as e:
        return ShardStopped(e)
    except ModelChanged as e:
        error = f"the engine on worker {get_worker().address} loaded another model: {e}"
        record_failure(output_url, shard.shard_id, error)
        return ShardFailed(f"ModelChanged: {error}")


def _lazy_engine(plugin_name: str, model_pin: ModelPin | None, output_url: str) -> LazyEngine:
    """This worker's resident engine loop (every shard of the worker shares its batch), loaded only when the shard
    has a row to run (pipeline.shard.run_shard): its load returns the loop and the fingerprint of the model it
    loaded (waits for the load), after checking that model against the job's `model_pin` (None: no check); a shard
    that never loads it names the model its plugin would load, with the pin's fingerprint. The load raises
    ModelChanged, or RuntimeError when it failed."""
    plugin = engine_plugin(plugin_name)

    def load() -> tuple[EngineLoop, str | None]:
        loaded = plugin.loaded_model()
        if model_pin is not None:
            check_model_pin(model_pin, loaded, output_url)
        return plugin.loop(), loaded.fingerprint

    return LazyEngine(load, lambda: plugin.facts(model_pin))


def _run_shard_task(shard: Shard, prompt_column: str, output_url: str, cfg: RunConfig, plugin_name: str,
                    run_id: str, pinned: tuple[int, str] | None = None,
                    model_pin: ModelPin | None = None) -> dict[str, Any]:
    """shard_task's run of the shard. Polls this worker's stop signal (SIGTERM, spot notice;
    jobs.plugin.PreemptionPlugin) besides the ones run_shard watches itself (OUTPUT/_CANCEL). Reports progress as
    worker events on PROGRESS_TOPIC, tagged with `run_id` and the shard id. The engine loads when the shard has a
    row to run (_lazy_engine); the model the worker loaded is checked against `model_pin` before any row runs
    (ModelChanged); rows and accounting carry its fingerprint.
    Returns the shard's accounting row.
    Raises WorkerPreempted when this worker's stop signal stopped the shard (its finished rows committed), and what
    run_shard raises: ShardInterrupted (a cancel), ShardError (unreadable input), storage errors after retries.
    """
    worker = get_worker()
    pending = [0, 0]
    last = [time.monotonic()]

    def flush() -> None:
        worker.log_event(PROGRESS_TOPIC, {"run": run_id, "shard": shard.shard_id, "rows": pending[0],
                                          "tokens": pending[1]})
        pending[0] = pending[1] = 0
        last[0] = time.monotonic()

    def progress(rows: int, tokens: int) -> None:
        pending[0] += rows
        pending[1] += tokens
        if time.monotonic() - last[0] >= PROGRESS_INTERVAL_S:
            flush()

    preemption = get_preemption()
    if preemption is None:
        return run_shard(_lazy_engine(plugin_name, model_pin, output_url), shard, prompt_column, output_url, cfg,
                         progress=progress, pinned=pinned)
    if preemption.stop.is_set():
        # This worker is going away (SIGTERM, spot notice): start nothing here. Take it out now and wait; once the
        # scheduler has removed it, it hands this task to another worker.
        preemption.leave(worker)
        preemption.closed.wait(RETIRE_WAIT_S)
        raise WorkerPreempted(0, shard.num_rows, worker.address, preemption.stop.reason)
    preemption.shard_started()
    interrupted = False
    try:
        # The worker's signal alone watches the notice file and URL, so a stop it did not see is a cancel.
        return run_shard(_lazy_engine(plugin_name, model_pin, output_url), shard, prompt_column, output_url, cfg,
                         progress=progress, should_stop=preemption.stop.is_set, watch_notices=False, pinned=pinned)
    except ShardInterrupted as e:
        if not preemption.stop.is_set():
            raise  # a cancel (OUTPUT/_CANCEL), seen by run_shard itself
        interrupted = True
        raise WorkerPreempted(e.rows_committed, e.rows_in_flight, worker.address, preemption.stop.reason) from e
    finally:
        if pending[0] or pending[1]:
            flush()
        preemption.shard_ended(interrupted)
