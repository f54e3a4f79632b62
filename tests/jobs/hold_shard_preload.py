"""A Dask worker preload for tests (`dask worker --preload tests/jobs/hold_shard_preload.py`): makes a test's timing
its own instead of the machine's. The first worker process (of all those sharing the claim file) whose engine has
finished HOLD_SHARD_AFTER_ROWS rows holds its engine loop until its shards are told to stop (the worker's stop
signal, a notice, a cancel): the rows already finished are delivered and checkpointed, the others cannot finish
before the stop, however fast or slow the machine. Its worker process id goes into the claim file (HOLD_SHARD_CLAIM,
written atomically) as the hold begins, so the test knows which worker to stop. Other workers never hold: a shard
resumed elsewhere runs through.

How: the shard's `should_stop` (pipeline.shard.generate_rows's argument, polled by the engine loop's step thread
before every step) is wrapped: once the hold begins it returns only when the real one says stop. Finished rows are
counted from LLMEngine.step, in that same thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pipeline.shard as shard_module
from engine.llm_engine import LLMEngine

CLAIM = os.environ["HOLD_SHARD_CLAIM"]
AFTER_ROWS = int(os.environ.get("HOLD_SHARD_AFTER_ROWS", "2"))
HANG_GUARD_S = 900.0  # only so that a broken test ends: the hold is released by the stop, not by time

_finished = [0]
_holder: list[bool] = []  # [whether this process holds], once decided
_lock = threading.Lock()
# Dask may import a preload twice in one process: wrap the originals, never a wrapper of them.
_real_step = getattr(LLMEngine.step, "unheld", LLMEngine.step)
_real_generate_rows = getattr(shard_module.generate_rows, "unheld", shard_module.generate_rows)


def _counting_step(self: LLMEngine, *args: Any, **kwargs: Any) -> Any:
    finished = _real_step(self, *args, **kwargs)
    _finished[0] += len(finished)
    return finished


def _holds() -> bool:
    """Whether this process won the claim (decided once, by an O_EXCL create of the claim's hard link)."""
    with _lock:
        if not _holder:
            tmp = f"{CLAIM}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            try:
                os.link(tmp, CLAIM)  # create-only: one process wins; the file is whole when it appears
                _holder.append(True)
            except FileExistsError:
                _holder.append(False)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        return _holder[0]


def _held_generate_rows(engine: Any, rows: Any, cfg: Any, progress: Any = None, *,
                        should_stop: Callable[[], bool] | None = None, **kwargs: Any) -> Any:
    def held_stop() -> bool:
        if should_stop is None or _finished[0] < AFTER_ROWS or not _holds():
            return should_stop is not None and should_stop()
        guard = time.monotonic() + HANG_GUARD_S
        while not should_stop() and time.monotonic() < guard:
            time.sleep(0.02)
        return True

    return _real_generate_rows(engine, rows, cfg, progress, should_stop=held_stop, **kwargs)


_counting_step.unheld = _real_step  # type: ignore[attr-defined]
_held_generate_rows.unheld = _real_generate_rows  # type: ignore[attr-defined]
LLMEngine.step = _counting_step  # type: ignore[method-assign]
shard_module.generate_rows = _held_generate_rows
