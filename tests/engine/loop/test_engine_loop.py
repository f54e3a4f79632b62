"""engine.loop.engine_loop: several submitters share one resident engine loop (tiny random model, real GSM8K
prompts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.loop.engine_loop import EngineLoop

PARAMS = SamplingParams(max_tokens=12)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def loop(tiny_engine: LLMEngine, request: pytest.FixtureRequest) -> Iterator[EngineLoop]:
    """An engine loop over the tiny model, with synchronous steps and with asynchronous scheduling (the CUDA
    default, LLMEngine.step): shards sharing the engine, stops, aborts and failures must hold under both."""
    engine = tiny_engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=16,
                                                  async_scheduling=request.param))
    loop = EngineLoop(engine)
    yield loop
    loop.close(timeout_s=30)
    assert not engine.scheduler.has_unfinished
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks  # nothing leaked
    engine.kv_cache_manager.check_integrity()


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.output_token_ids for o in outputs]


def test_two_submitters_share_steps_and_get_their_own_outputs(loop: EngineLoop, gsm8k_questions: list[str]) -> None:
    a, b = gsm8k_questions[:5], gsm8k_questions[5:10]
    alone_a = loop.engine.generate(a, PARAMS)
    alone_b = loop.engine.generate(b, PARAMS)
    loop.engine.step_stats.reset()
    seen: dict[str, list[tuple[int, str, str]]] = {"a": [], "b": []}
    results: dict[str, list[RequestOutput]] = {}

    b_submitted = threading.Event()

    def submitter(name: str, prompts: list[str]) -> None:
        # Both use ids "0".."4": ids need only be unique within a submission. a's should_stop (polled by the step
        # thread before every step) holds the loop until b has submitted: the two share steps however the threads
        # are scheduled (a's 12 tokens could all be generated before a starved thread b submits).
        hold = (lambda: not b_submitted.wait(120)) if name == "a" else None
        sub = loop.submit(prompts, PARAMS, clock=clocks[name], should_stop=hold)
        if name == "b":
            b_submitted.set()
        results[name] = sub.run(lambda i, out: seen[name].append((i, out.request_id, threading.current_thread().name)))

    clocks = {"a": loop.clock(), "b": loop.clock()}
    threads = [threading.Thread(target=submitter, args=(n, p), name=f"submitter-{n}") for n, p in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _tokens(results["a"]) == _tokens(alone_a) and _tokens(results["b"]) == _tokens(alone_b)
    assert [o.request_id for o in results["b"]] == [str(i) for i in range(5)]
    for name in seen:  # each output once, its callback on the submitter's own thread
        assert sorted(i for i, _, _ in seen[name]) == list(range(5))
        assert {rid for _, rid, _ in seen[name]} == {str(i) for i in range(5)}
        assert {t for _, _, t in seen[name]} == {f"submitter-{name}"}
    stats = loop.engine.step_stats
    assert max(stats.histogram()) > 5  # some step ran rows of both submissions
    # The steps' time is split between the two by the tokens each fed: the shares add up to the steps' time.
    assert clocks["a"].share_s > 0 and clocks["b"].share_s > 0
    assert clocks["a"].share_s + clocks["b"].share_s == pytest.approx(loop.step_seconds, rel=1e-9)


def test_should_stop_aborts_one_submitters_rows_only(loop: EngineLoop, gsm8k_questions: list[str]) -> None:
    long = SamplingParams(max_tokens=40)
    stop = threading.Event()
    stopped = loop.submit(gsm8k_questions[:4], long, should_stop=stop.is_set)
    other = loop.submit(gsm8k_questions[4:8], long)
    finished = []

    def on_output(i: int, out: RequestOutput) -> None:
        finished.append(i)

    stop.set()
    out_stopped = stopped.run(on_output)
    out_other = other.results()
    assert [o.finish_reason for o in out_stopped] == ["abort"] * 4 and not finished  # aborts never reach on_output
    assert all(not o.output_token_ids for o in out_stopped)
    assert [o.finish_reason for o in out_other] == ["length"] * 4
    assert all(o.num_output_tokens == 40 for o in out_other)


def test_a_failing_callback_stops_its_submitter_not_the_other(loop: EngineLoop, gsm8k_questions: list[str]) -> None:
    long = SamplingParams(max_tokens=30)
    # Short rows finish first: the failing submitter's first callback comes while its long rows still run.
    failing = loop.submit(gsm8k_questions[:4], [SamplingParams(max_tokens=2)] + [long] * 3)
    other = loop.submit(gsm8k_questions[4:8], long)

    def commit(i: int, out: RequestOutput) -> None:
        raise OSError("the store is gone")

    with pytest.raises(OSError, match="the store is gone"):
        failing.run(commit)
    assert sorted(o.finish_reason for o in failing.outputs) == ["abort"] * 3 + ["length"]
    assert [o.finish_reason for o in other.results()] == ["length"] * 4


def test_a_failed_step_reaches_every_submitter_and_the_loop_serves_on(loop: EngineLoop,
                                                                      gsm8k_questions: list[str]) -> None:
    runner = loop.engine.runner
    method = "launch" if loop.engine.async_scheduling else "execute"
    real_run = getattr(runner, method)
    calls = [0]
    both_in = threading.Event()

    def flaky(*args: object, **kwargs: object) -> object:
        # The first step waits until both submissions are posted, so the third step (the one that fails) holds the
        # rows of both, however fast this machine steps (a step may not outrun the second submit).
        both_in.wait(timeout=60)
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("device lost")
        return real_run(*args, **kwargs)

    setattr(runner, method, flaky)
    try:
        subs = [loop.submit(gsm8k_questions[:3], PARAMS), loop.submit(gsm8k_questions[3:6], PARAMS)]
        both_in.set()
        for sub in subs:
            with pytest.raises(RuntimeError, match="device lost"):
                sub.results()
        after = loop.submit(gsm8k_questions[:2], PARAMS).results()
    finally:
        setattr(runner, method, real_run)
    assert [o.finish_reason for o in after] == ["length"] * 2


def test_bad_prompts_come_back_as_errors_at_once(loop: EngineLoop, gsm8k_questions: list[str]) -> None:
    out = loop.submit(["", gsm8k_questions[0]], PARAMS, request_ids=["x", "y"]).results()
    assert [(o.request_id, o.finish_reason) for o in out] == [("x", "error"), ("y", "length")]
    assert out[0].error and "empty" in out[0].error
    assert loop.submit([""], PARAMS).results()[0].finish_reason == "error"  # nothing queued: done at once


def test_generate_refuses_while_the_loop_holds_requests(loop: EngineLoop, gsm8k_questions: list[str]) -> None:
    sub = loop.submit(gsm8k_questions[:2], SamplingParams(max_tokens=200))
    while not loop.engine.scheduler.has_unfinished and not sub._done:
        pass
    with pytest.raises(RuntimeError, match="submit to that loop"):
        loop.engine.generate(gsm8k_questions[2:3], PARAMS)
    sub.abort()
    assert {o.finish_reason for o in sub.results()} <= {"abort", "length"}


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def test_scheduler_merges_new_requests_longest_first_behind_preempted_ones() -> None:
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=256)
    key = lambda r: -(r.num_prompt_tokens + r.sampling_params.max_tokens)  # noqa: E731
    sched.add_requests([_request("a", 4, 4), _request("b", 8, 8)], key=key)
    resumed = _request("p", 2, 2)
    resumed.num_preemptions = 1
    sched.waiting.appendleft(resumed)
    sched.add_requests([_request("c", 20, 4), _request("d", 2, 2)], key=key)
    assert [r.request_id for r in sched.waiting] == ["p", "c", "b", "a", "d"]
    sched.schedule()
    aborted = sched.abort_requests({"c", "d", "nope"})
    assert sorted(r.request_id for r in aborted) == ["c", "d"]
    assert all(r.finish_reason == "abort" for r in aborted)
    assert {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting} == {"p", "b", "a"}
    sched.abort_all()
    assert sched.kv_cache_manager.num_free_blocks == 64
    sched.kv_cache_manager.check_integrity()


def test_a_failure_in_the_loops_own_bookkeeping_answers_the_submitter(loop: EngineLoop, gsm8k_questions: list[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real_handle = loop._handle

    def broken(inbox: list) -> None:
        raise SystemError("the loop's own bookkeeping failed")

    monkeypatch.setattr(loop, "_handle", broken)
    with pytest.raises(SystemError, match="bookkeeping"):  # an error, not a submitter waiting forever
        loop.submit(gsm8k_questions[:2], PARAMS).results()
    monkeypatch.setattr(loop, "_handle", real_handle)
    assert [o.finish_reason for o in loop.submit(gsm8k_questions[:2], PARAMS).results()] == ["length"] * 2


def _wait_for_steps(loop: EngineLoop, steps: int) -> None:
    deadline = time.monotonic() + 60
    while loop.engine.step_stats.num_steps < steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the loop ran {loop.engine.step_stats.num_steps} steps in 60 s")
        time.sleep(0.01)


def test_close_with_abort_ends_the_step_thread_mid_batch(loop: EngineLoop, gsm8k_questions: list[str]) -> None:
    """close(abort=True) (a closing worker's teardown, the atexit hook) aborts the rows in the engine after the step
    in progress and returns once the step thread has ended: nothing steps on while a process exits."""
    loop.engine.step_stats.reset()
    sub = loop.submit(gsm8k_questions[:4], SamplingParams(max_tokens=4000))
    _wait_for_steps(loop, 3)
    assert loop.close(timeout_s=30, abort=True)
    assert loop._thread is not None and not loop._thread.is_alive()
    assert [o.finish_reason for o in sub.results()] == ["abort"] * 4
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(gsm8k_questions[:1], PARAMS)
    # A submit that passed its start() check just before the close: answered at once, never left waiting.
    loop.start = lambda: loop  # type: ignore[method-assign]
    late = loop.submit(gsm8k_questions[:1], PARAMS)
    with pytest.raises(RuntimeError, match="closed"):
        late.results()


EXIT_SCRIPT = """
import atexit, json, sys, threading, time

def check():  # registered before engine.loop.engine_loop's hook, so it runs after it (atexit is last in, first out)
    alive = [t.name for t in threading.enumerate() if t.name == "tokenmill-engine-loop" and t.is_alive()]
    print("loop threads alive at exit:", alive, flush=True)

atexit.register(check)
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loop.engine_loop import EngineLoop

engine = LLMEngine.from_model(sys.argv[1], EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))
loop = EngineLoop(engine)
loop.submit(json.loads(open(sys.argv[2]).read()), SamplingParams(max_tokens=4000))
while engine.step_stats.num_steps < 3:
    time.sleep(0.01)
print("exiting mid-batch", flush=True)
sys.exit(0)
"""


def test_importing_the_loop_registers_no_exit_hook_until_a_loop_starts() -> None:
    """Importing engine.loop.engine_loop leaves the process as it was: engine.loop.exit_hook's close_all_at_exit
    joins atexit only when a loop starts its step thread, and once per process."""
    script = ("import atexit\n"
              "calls = []\n"
              "register = atexit.register\n"
              "atexit.register = lambda f, *a, **k: (calls.append(f), register(f, *a, **k))[1]\n"
              "from engine.loop import engine_loop\n"
              "from engine.loop import exit_hook as m\n"
              "assert m.close_all_at_exit not in calls, calls\n"
              "m.register_exit_hook(); m.register_exit_hook()\n"
              "assert calls.count(m.close_all_at_exit) == 1, calls\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_process_exiting_mid_batch_aborts_and_joins_its_loop(tiny_model: str, gsm8k_questions: list[str],
                                                                tmp_path: Path) -> None:
    """A process that exits while its loop steps (sys.exit on the main thread, as a Dask worker process ends):
    the atexit hook aborts the rows and joins the step thread before the interpreter finalizes, so no daemon thread
    is in torch then (that thread used to be ended inside C++ by pthread_exit: std::terminate, "terminate called
    without an active exception", exit 134)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(gsm8k_questions[:8]))
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, tiny_model, str(prompts)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "exiting mid-batch" in proc.stdout and "loop threads alive at exit: []" in proc.stdout, proc.stdout
    assert "terminate called" not in proc.stderr
