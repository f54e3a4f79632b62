"""A Dask worker preload for tests: makes a test's timing its own instead of the machine's. Load it with
`dask worker --preload tests/jobs/hold_shard_preload.py`, `LocalCluster(preload=[...])`, or, for the workers of a
`tokenmill run` process, DASK_DISTRIBUTED__WORKER__PRELOAD='["…/hold_shard_preload.py"]' in its environment.

Armed (HOLD_SHARD_CLAIM in the worker's environment as it starts, or `arm(...)` run on the workers with
Client.run), the first worker process (of all those armed with the same claim file) in which `shards` shards have
each finished `after_rows` rows since the arming holds its engine loop until those shards are told to stop (the
worker's stop signal, a notice, a cancel, a signal to the client): the rows already finished are delivered and
checkpointed, the others cannot finish before the stop, however fast or slow the machine. With `shards` > 1 the
loop also runs no step until that many shards have submitted their rows, so they share the engine from the start.
The holder's process id goes into the claim file (written atomically) as the hold begins, so the test knows which
worker to stop. Other processes never hold, nor do shards once the claim is taken elsewhere: a shard resumed on a
restarted or another worker runs through.

How: EngineLoop.submit gets a `should_stop` (polled by the loop's step thread before every step) that, once the
hold begins, returns only when the shard's own one says stop. Finished rows are counted per submission from
LLMEngine.step, in that same thread, so the count is never behind the engine. Nothing is patched until the
process is armed: a test may import this module (for `arm`) without changing its own process.

Environment (read by dask_setup): HOLD_SHARD_CLAIM (the claim file; unset: not armed), HOLD_SHARD_AFTER_ROWS
(default 2), HOLD_SHARD_SHARDS (default 1).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

HANG_GUARD_S = 900.0  # only so that a broken test ends: the hold is released by the stop, not by time

_lock = threading.Lock()
_armed: dict[str, Any] = {}  # claim, after_rows, shards; empty: not armed
_finished: dict[tuple[int, str], int] = {}  # (id(engine), submission key) -> rows finished since the arming
_submitted: list[tuple[int, str]] = []  # submissions made since the arming, in order
_holder: list[bool] = []  # [whether this process holds], once decided per arming


def arm(claim: str, after_rows: int = 2, shards: int = 1) -> None:
    """Arm this process (see the module docstring): hold once `shards` shards submitted from now on have each
    finished `after_rows` rows, if this process is the first to write its pid to the file `claim`."""
    _install()
    with _lock:
        _armed.clear()
        _armed.update(claim=claim, after_rows=after_rows, shards=shards)
        _finished.clear()
        _submitted.clear()
        _holder.clear()


def disarm() -> None:
    """Hold nothing from now on (a hold in progress still waits for its stop)."""
    with _lock:
        _armed.clear()


def _holds(claim: str) -> bool:
    """Whether this process won the claim (decided once per arming, by an O_EXCL create of the claim's hard
    link)."""
    with _lock:
        if not _holder:
            tmp = f"{claim}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            try:
                os.link(tmp, claim)  # create-only: one process wins; the file is whole when it appears
                _holder.append(True)
            except FileExistsError:
                _holder.append(False)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        return _holder[0]


def _held(should_stop: Callable[[], bool], key: list[tuple[int, str]]) -> Callable[[], bool]:
    """`should_stop` of the submission whose (engine id, key) goes into `key` once it is made, held as armed."""
    def wait_for_stop(until: Callable[[], bool]) -> bool:
        guard = time.monotonic() + HANG_GUARD_S
        while not should_stop():
            if until() or time.monotonic() > guard:
                return False
            time.sleep(0.01)
        return True

    def held_stop() -> bool:
        armed = dict(_armed)
        if not armed or not key or (_holder and not _holder[0]):
            return should_stop()
        claim, shards = armed["claim"], armed["shards"]
        if (len(_submitted) < shards and not os.path.exists(claim)  # let the other shards in first
                and wait_for_stop(lambda: len(_submitted) >= shards or not _armed or os.path.exists(claim))):
            return True
        mine = [k for k in _submitted[:shards] if _finished.get(k, 0) >= armed["after_rows"]]
        if key[0] not in _submitted[:shards] or len(mine) < shards or not _holds(claim):
            return should_stop()
        return wait_for_stop(lambda: False) or True  # the hold: until this shard is told to stop

    return held_stop


def _install() -> None:
    """Wrap LLMEngine.step (count finished rows) and EngineLoop.submit (hold); idempotent. Dask may import a
    preload twice in one process: wrap the originals, never a wrapper of them."""
    from engine.llm_engine import LLMEngine
    from engine.loop.engine_loop import EngineLoop

    real_step = getattr(LLMEngine.step, "unheld", LLMEngine.step)
    real_submit = getattr(EngineLoop.submit, "unheld", EngineLoop.submit)

    def counting_step(self: LLMEngine, *args: Any, **kwargs: Any) -> Any:
        finished = real_step(self, *args, **kwargs)
        for req in finished:  # the loop's request ids: "<submission key>:<index>"
            k = (id(self), str(req.request_id).split(":", 1)[0])
            _finished[k] = _finished.get(k, 0) + 1
        return finished

    def holding_submit(self: EngineLoop, *args: Any, should_stop: Callable[[], bool] | None = None,
                       **kwargs: Any) -> Any:
        if should_stop is None:
            return real_submit(self, *args, **kwargs)
        key: list[tuple[int, str]] = []
        sub = real_submit(self, *args, should_stop=_held(should_stop, key), **kwargs)
        with _lock:
            key.append((id(self.engine), str(sub.key)))
            _submitted.append(key[0])
        return sub

    counting_step.unheld = real_step  # type: ignore[attr-defined]
    holding_submit.unheld = real_submit  # type: ignore[attr-defined]
    LLMEngine.step = counting_step  # type: ignore[method-assign]
    EngineLoop.submit = holding_submit  # type: ignore[method-assign]


def dask_setup(worker: Any) -> None:
    """Dask's preload hook: arm from the environment when HOLD_SHARD_CLAIM names a claim not yet taken. Otherwise
    nothing: the engine is not imported before the worker registers (a worker restarted after the hold, e.g. by
    the nanny after a SIGTERM, starts as fast as without the preload), and `arm` installs the wrappers later."""
    claim = os.environ.get("HOLD_SHARD_CLAIM")
    if claim and not os.path.exists(claim):
        arm(claim, int(os.environ.get("HOLD_SHARD_AFTER_ROWS", "2")), int(os.environ.get("HOLD_SHARD_SHARDS", "1")))
