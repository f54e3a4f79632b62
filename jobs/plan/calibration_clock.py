"""The forecast's clock (jobs.plan.forecast, jobs.plan.forecast_pooling): device-seconds of the engine calls that
calibrate it, and how much longer their wall time was (other load on the machine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import LLMEngine

# (wall s, device s) of every timed call of the calibration in progress (one at a time per process).
_CLOCKS: list[tuple[float, float]] = []


def start_clock() -> None:
    """Forget the calls of an earlier calibration: load_stretch counts this one's."""
    _CLOCKS.clear()


def timed(engine: LLMEngine, call: Callable[[], Any]) -> tuple[float, Any]:
    """(device-seconds, result) of `call()`, one engine call on this thread. On the CPU the device time is this
    thread's CPU time (time.thread_time): the engine computes on the calling thread, which does its share of every
    op and sleeps at OpenMP barriers (OMP_WAIT_POLICY=PASSIVE), so time other processes take the cores from it is
    not counted, where wall time counted the machine's load at calibration time. On CUDA: wall time (the call
    returns once the outputs are on the host; the GPU is the job's alone)."""
    cpu = engine.device_name == "cpu"
    t0, c0 = time.perf_counter(), time.thread_time()
    out = call()
    wall = time.perf_counter() - t0
    _CLOCKS.append((wall, time.thread_time() - c0 if cpu else wall))
    return _CLOCKS[-1][1], out


def load_stretch() -> float:
    """The calibration's wall time over its device time since start_clock (Forecast.load_stretch: 1 on a quiet
    machine)."""
    return sum(w for w, _ in _CLOCKS) / max(sum(d for _, d in _CLOCKS), 1e-9)
