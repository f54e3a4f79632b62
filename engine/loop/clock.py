"""The device clock of a shared engine: what each caller (a shard attempt) of one EngineLoop is billed.

A step's seconds are split by the tokens each submission fed to it (the step thread adds each share to the
submission's DeviceClock, engine.loop.engine_loop.EngineLoop._step); the wall time in which no step ran is split
equally among the clocks open in it (IdleShare). Callers that share the engine for T seconds are billed T in all.
Plain Python: it knows nothing of the loop, which hands each clock its IdleShare.
"""

from __future__ import annotations

import threading
import time


class IdleShare:
    """The wall time in which a shared engine ran no step, split equally among the callers (DeviceClocks) alive in
    it: processor sharing of the idle device (each of n callers off the engine at once is billed dt / n).

    `per_caller_s()` is the running integral of dt / n over the idle time in which n >= 1 clocks were open; a clock
    bills the increase of that integral between its open and its close. Stepping time is not in it (the step
    thread splits each step by tokens, EngineLoop._step). Thread-safe: clocks open, close and read from their own
    threads, the step thread marks steps.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0  # clocks open
        self._stepping = False
        self._integral = 0.0  # seconds: the sum of dt / open over idle time
        self._mark = time.monotonic()

    def _advance(self, now: float) -> None:
        if not self._stepping and self._open:
            self._integral += (now - self._mark) / self._open
        self._mark = now

    def per_caller_s(self) -> float:
        """Idle seconds billed to each open clock since this engine loop began (see the class docstring)."""
        with self._lock:
            self._advance(time.monotonic())
            return self._integral

    def open(self) -> float:
        """Count one more clock from now; returns the integral it starts from."""
        with self._lock:
            self._advance(time.monotonic())
            self._open += 1
            return self._integral

    def close(self) -> float:
        """Count one clock less from now; returns the integral it ends at."""
        with self._lock:
            self._advance(time.monotonic())
            self._open -= 1
            return self._integral

    def step(self, stepping: bool) -> None:
        """The step thread: a step starts (True) or ends (False)."""
        with self._lock:
            self._advance(time.monotonic())
            self._stepping = stepping


class DeviceClock:
    """Device-seconds of one caller of a shared engine (a shard attempt), from the moment it is made to `close()`.

    `device_s()` = its share of every step run since (each step's seconds split by the tokens each submission fed
    to it; shares of submissions made with this clock add up here) + its share of the wall time in which the engine
    ran no step at all (reading input, committing, idle: the device was held for its callers), split equally among
    the clocks open in it (IdleShare). Callers that share the engine for T seconds are billed T in all, not a
    multiple of it; a caller alone on the engine is billed its wall time. Use it as a context manager, or call
    `close()` when the caller is done: its bill stops there (a clock left open keeps a share of the idle time).
    Thread-safe to read from any thread.

    Args:
        idle: the idle-time share of the engine loop the caller submits to (EngineLoop.idle; `EngineLoop.clock()`
            makes one); None: the caller holds an engine alone (it calls LLMEngine.generate itself) and is billed
            its wall time.
    """

    def __init__(self, idle: IdleShare | None) -> None:
        self._idle = idle
        self._t0 = time.monotonic()
        self._idle0 = idle.open() if idle is not None else 0.0
        self._final: float | None = None
        self.share_s = 0.0  # this caller's share of step time (seconds), added by the step thread

    def device_s(self) -> float:
        """Device-seconds billed to this caller so far, or in all once closed (see the class docstring)."""
        if self._final is not None:
            return self._final
        if self._idle is None:
            return time.monotonic() - self._t0
        return self.share_s + self._idle.per_caller_s() - self._idle0

    def close(self) -> float:
        """Stop billing this caller (idempotent); returns its device-seconds in all."""
        if self._final is None:
            if self._idle is None:
                self._final = time.monotonic() - self._t0
            else:
                self._final = self.share_s + self._idle.close() - self._idle0
        return self._final

    def __enter__(self) -> DeviceClock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
