"""engine.loop.clock.DeviceClock / IdleShare: shards that share one engine are billed its time once. Steps are split
by the tokens each caller fed them; the time between steps is split equally among the callers open in it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loop.clock import DeviceClock
from engine.loop.engine_loop import EngineLoop


class FakeTime:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_idle_time_is_split_among_the_open_clocks(tiny_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr("engine.loop.clock.time", SimpleNamespace(monotonic=fake.monotonic))
    loop = EngineLoop(tiny_engine)  # never started: no step runs, all of its time is idle
    a = DeviceClock(loop.idle)
    fake.now += 10  # a alone: 10 s
    b = DeviceClock(loop.idle)
    fake.now += 10  # both open: 5 s each
    assert (a.device_s(), b.device_s()) == (pytest.approx(15.0), pytest.approx(5.0))
    assert a.close() == pytest.approx(15.0)
    loop.idle.step(True)
    fake.now += 4  # a step: none of it is idle time (the step thread bills steps by tokens)
    loop.idle.step(False)
    fake.now += 6  # b alone
    assert a.device_s() == pytest.approx(15.0)  # closed: its bill stays
    with b:
        pass
    assert b.device_s() == pytest.approx(11.0)
    assert a.device_s() + b.device_s() + 4 == pytest.approx(30.0)  # the 30 s the loop was held, once
    c = DeviceClock(None)  # a caller that holds an engine alone: its wall time
    fake.now += 7
    assert c.close() == pytest.approx(7.0)


def test_two_submitters_are_billed_the_wall_time_once(tiny_engine: LLMEngine, gsm8k_questions: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers with rows in the same steps, each with time off the engine (as a shard reads its input and
    commits): their bills add up to the wall time from the first clock's start to the last one's end, not more.
    That wall time is read from the clocks' own readings of time.monotonic (recorded), not around them: a test
    thread woken late by a busy machine does not lengthen it."""
    loop = EngineLoop(tiny_engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=16)))
    readings: list[float] = []

    def monotonic() -> float:
        readings.append(time.monotonic())
        return readings[-1]

    monkeypatch.setattr("engine.loop.clock.time", SimpleNamespace(monotonic=monotonic))
    bills: dict[str, float] = {}
    clocks = {"a": DeviceClock(loop.idle), "b": DeviceClock(loop.idle)}  # the first reading: a's start

    def caller(name: str, prompts: list[str]) -> None:
        with clocks[name] as clock:
            time.sleep(0.05)  # off the engine (input read) while the other one's rows may run
            loop.submit(prompts, SamplingParams(max_tokens=8), clock=clock).results()
            bills[name] = clock.close()

    threads = [threading.Thread(target=caller, args=(n, p)) for n, p in
               (("a", gsm8k_questions[:4]), ("b", gsm8k_questions[4:10]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(readings) - readings[0]  # the last reading: the last close (no step runs after it)
    loop.close(timeout_s=30)
    assert clocks["a"].share_s > 0 and clocks["b"].share_s > 0
    # Each step's seconds are measured inside the idle bookkeeping's marks, so the sum falls short of the wall time
    # by the marks' own microseconds per step, and never exceeds it.
    assert bills["a"] + bills["b"] <= wall
    assert bills["a"] + bills["b"] == pytest.approx(wall, rel=0.02)
