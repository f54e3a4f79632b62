"""A submission to the engine loop (engine.loop.engine_loop.EngineLoop): one submitter's batch, iterated in the
submitter's thread for its outputs as they finish, and the device clock that bills a submitter its share of the
shared steps (each step's seconds split by the tokens each submission fed to it) and of the engine's idle time."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.loop.engine_loop import EngineLoop

DONE = object()  # put on a submission's queue by the step thread: every output delivered


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
    Thread-safe to read from any thread. `loop` None: the caller holds an engine alone (it calls
    LLMEngine.generate itself) and is billed its wall time.
    """

    def __init__(self, loop: EngineLoop | None) -> None:
        self._loop = loop
        self._t0 = time.monotonic()
        self._idle0 = loop.idle.open() if loop is not None else 0.0
        self._final: float | None = None
        self.share_s = 0.0  # this caller's share of step time (seconds), added by the step thread

    def device_s(self) -> float:
        """Device-seconds billed to this caller so far, or in all once closed (see the class docstring)."""
        if self._final is not None:
            return self._final
        if self._loop is None:
            return time.monotonic() - self._t0
        return self.share_s + self._loop.idle.per_caller_s() - self._idle0

    def close(self) -> float:
        """Stop billing this caller (idempotent); returns its device-seconds in all."""
        if self._final is None:
            if self._loop is None:
                self._final = time.monotonic() - self._t0
            else:
                self._final = self.share_s + self._loop.idle.close() - self._idle0
        return self._final

    def __enter__(self) -> DeviceClock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(eq=False)
class Submission:
    """One submitter's batch in an EngineLoop: iterate it (in the submitter's thread) for (index, output) pairs as
    requests finish; `results()` for every output in submission order.

    Outputs: one per prompt; error outputs (prompts that cannot run) come first; an aborted request (its
    `should_stop` said stop, or `abort()`) comes back with finish_reason "abort" and no output tokens. Iterating
    raises the exception of a failed engine step (every request of the loop is then aborted) or of `should_stop`.
    """

    loop: EngineLoop
    key: int
    size: int
    start: float
    should_stop: Callable[[], bool] | None = None
    clock: DeviceClock | None = None
    outputs: list[RequestOutput | None] = field(default_factory=list)
    _queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _error: BaseException | None = None
    _done: bool = False
    remaining: int = 0  # requests still in the engine (step thread only)
    # n > 1: each prompt's finished samples until all n are in (step thread only)
    samples: dict[int, list[RequestOutput | None]] = field(default_factory=dict)

    def __iter__(self) -> Iterator[tuple[int, RequestOutput]]:
        while not self._done:
            item = self._queue.get()
            if item is DONE:
                self._done = True
                break
            if isinstance(item, BaseException):
                self._error = item
                continue
            index, out = item
            self.outputs[index] = out
            yield index, out
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Stop this submission's unfinished requests (from any thread); they come back with finish_reason "abort".
        The others' requests go on."""
        self.loop._post(("abort", self))

    def run(self, on_output: Callable[[int, RequestOutput], None]) -> list[RequestOutput]:
        """Call `on_output(index, output)` in this thread as each request finishes (aborted ones excepted: they
        never ran to an end); return every output in submission order. When `on_output` raises (a checkpoint
        commit that failed), this submission's unfinished requests are aborted, the rest of its outputs awaited
        (so its KV blocks are free), and the error raised; other submissions go on."""
        try:
            for index, out in self:
                if out.finish_reason != "abort":
                    on_output(index, out)
        except BaseException:
            if not self._done:
                self.abort()
                for _ in self:
                    pass
            raise
        return [o for o in self.outputs if o is not None]

    def results(self) -> list[RequestOutput]:
        """Wait for every output; return them in submission order. Raises as iterating does."""
        for _ in self:
            pass
        return [o for o in self.outputs if o is not None]
