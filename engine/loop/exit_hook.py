"""Closing the live engine loops before the interpreter finalizes (engine.loop.engine_loop's step threads).

A loop's step thread is a daemon (a process never waits on its rows to exit), so it must be done before the
interpreter finalizes: a daemon thread that is in C++ with the GIL released then (a step's torch ops, or freeing the
engine's tensors, THPVariable_clear) is ended by pthread_exit when it takes the GIL back, and that forced unwind
through a noexcept C++ frame is std::terminate: "terminate called without an active exception", an aborted process.
The atexit hook here (`close_all_at_exit`, registered when the first loop starts its thread, never at import) aborts
the requests of every live loop and joins its thread; jobs.plugin's teardown does the same when a Dask worker closes.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Protocol

#: Seconds an exiting process waits for a loop's step in progress to end (close_all_at_exit).
EXIT_JOIN_S = 60.0


class Closable(Protocol):
    """What the hook needs of a loop: EngineLoop.close."""

    def close(self, timeout_s: float | None = None, *, abort: bool = False) -> bool:
        """Abort (with `abort`) and end the loop's step thread within `timeout_s` seconds; whether it ended."""


# Every loop whose step thread was started and has not ended: close_all_at_exit closes them.
_LIVE: weakref.WeakSet[Closable] = weakref.WeakSet()
_registered = False  # close_all_at_exit registered with atexit (by the first loop that started its thread)
_lock = threading.Lock()


def close_all_at_exit(timeout_s: float = EXIT_JOIN_S) -> None:
    """Abort the requests of every live loop and wait up to `timeout_s` seconds each for its step thread to end
    (registered with atexit: it runs after the interpreter joined its non-daemon threads and before it finalizes,
    while a daemon thread can still take the GIL; see the module docstring)."""
    for loop in list(_LIVE):
        loop.close(timeout_s=timeout_s, abort=True)


def register_exit_hook() -> None:
    """Register close_all_at_exit with atexit once per process (a loop calls it as it first starts its step thread:
    importing a module changes nothing of the process)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(close_all_at_exit)
            _registered = True


def track(loop: Closable) -> None:
    """Count `loop` live (its step thread started): close_all_at_exit closes it. Held weakly."""
    _LIVE.add(loop)


def untrack(loop: Closable) -> None:
    """`loop`'s step thread has ended: close_all_at_exit leaves it alone."""
    _LIVE.discard(loop)
