"""A resident engine loop: one thread owns an LLMEngine and steps it while any request is in it; other threads
submit batches of prompts and receive their outputs as they finish.

Several submitters (a worker's shards, say) share one continuous batch, so the batch never drains at the end of one
submitter's rows while another's wait: the next batch's rows join while the current one's tail finishes (as Ray
Data streams blocks into one vLLM engine). Admission stays length-aware across submitters: every new submission is
merged into the waiting queue longest first (prompt + max_tokens; the LPT rule, Graham 1969).

The step thread does engine work only. Tokenizing a submission's prompts happens in the submitting thread, and each
output is handed to its submitter through a queue: the submitter's per-row callbacks (checkpoint commits, progress)
run in its own thread, and an exception there stops that submitter's rows only.

Device time of shared steps is shared by the tokens each submission computed in them: a step of T seconds that fed
n_i tokens of submission i (prefill chunks and decodes, sum N) bills n_i / N x T to submission i (engine.loop.clock.
DeviceClock); the time between steps is split equally among the callers whose clocks are open in it (IdleShare).

The loop asks the engine only for what LLMEngine offers every caller (make_requests, add_requests, step, abort_requests,
abort_all, output_of): the engine owns its requests' clean-up (KV blocks, batch rows, logits-processor state).

The step thread is a daemon, so it must be done before the interpreter finalizes: engine.loop.exit_hook aborts the
requests of every live loop and joins its thread at exit (registered when the first loop starts its thread, not at
import), and jobs.plugin's teardown does the same when a Dask worker closes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from engine.core.request import Request
from engine.llm_engine import LLMEngine, Prompt
from engine.loop import exit_hook
from engine.loop.clock import DeviceClock, IdleShare
from engine.loop.submission import DONE, Submission
from engine.outputs import RequestOutput
from engine.processing.parallel_sampling import ParentRequest, engine_requests
from engine.sampling_params import SamplingParams

__all__ = ["EngineLoop"]

log = logging.getLogger(__name__)

class EngineLoop:
    """A step thread that owns `engine` and serves submissions from any number of threads at once.

    Start it with `start()` (or the first `submit`); `close()` ends the thread once the engine is empty. While a
    loop runs, only it may step the engine (`LLMEngine.generate` refuses to run while the loop holds requests).
    `LLMEngine.generate` users get the same batching with `loop.submit(...).results()`.

    Args:
        engine: the engine to own.
        thread_init: called once on the step thread before its first step (e.g. torch.set_num_threads, which
            OpenMP keeps per OS thread). None: the thread count of the thread that made the loop.
    Attributes:
        step_seconds: seconds of every step run so far (time.perf_counter()).
    """

    def __init__(self, engine: LLMEngine, thread_init: Callable[[], None] | None = None) -> None:
        if thread_init is None:
            import torch

            threads = torch.get_num_threads()

            def thread_init() -> None:
                torch.set_num_threads(threads)

        self.engine = engine
        self._thread_init = thread_init
        self._cv = threading.Condition()
        # ("add", submission, [(request, index, caller's id, its parent)]) | ("abort", submission)
        self._inbox: list[tuple] = []
        # engine request id -> (submission, prompt index, the caller's id, its parent request for one of n samples)
        self._owner: dict[str, tuple[Submission, int, str, ParentRequest | None]] = {}
        self._active: dict[int, Submission] = {}
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._aborting = False
        self._ended = False  # the step thread returned after close(): nothing reads the inbox any more
        self._broken: BaseException | None = None
        self.step_seconds = 0.0
        self.idle = IdleShare()  # the wall time without a step, split among the open DeviceClocks

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineLoop:
        """The engine's resident loop, made (and started) at the first call: every caller of one engine shares it."""
        loop = getattr(engine, "_engine_loop", None)
        if loop is None or loop._closed:
            loop = cls(engine)
            engine._engine_loop = loop  # type: ignore[attr-defined]
        return loop.start()

    def start(self) -> EngineLoop:
        """Start the step thread (idempotent). Raises RuntimeError after `close()`."""
        with self._cv:
            if self._broken is not None:
                raise RuntimeError(f"this engine loop stopped on {type(self._broken).__name__}: {self._broken}; "
                                   "make a new one") from self._broken
            if self._closed:
                raise RuntimeError("this engine loop is closed; make a new one")
            if self._thread is None:
                exit_hook.register_exit_hook()
                self._thread = threading.Thread(target=self._run, name="tokenmill-engine-loop", daemon=True)
                self._thread.start()
                exit_hook.track(self)
        return self

    def close(self, timeout_s: float | None = None, *, abort: bool = False) -> bool:
        """Let the step thread end once no request is left; wait up to `timeout_s` seconds (None: until it ends).
        `abort`: abort every request in the loop after the step in progress (each submission gets its rows as
        finish_reason "abort" outputs, as with `should_stop`) instead of finishing them. Returns whether the step
        thread has ended (True too when it never started)."""
        with self._cv:
            self._closed = True
            self._aborting = self._aborting or abort
            self._cv.notify_all()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return thread is None
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("engine loop: the step thread did not end within %s s of close()", timeout_s)
            return False
        exit_hook.untrack(self)
        return True

    def clock(self) -> DeviceClock:
        """A DeviceClock started now: pass it to `submit` to bill this caller's share of the steps to it."""
        return DeviceClock(self.idle)

    def submit(self, prompts: Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
               request_ids: Sequence[str] | None = None, use_chat_template: bool = True,
               allow_special_tokens: bool = False, should_stop: Callable[[], bool] | None = None,
               clock: DeviceClock | None = None) -> Submission:
        """Queue prompts (arguments as LLMEngine.generate's) and return their Submission at once.

        The prompts are tokenized here, in the caller's thread; prompts that cannot run are error outputs at
        once. `should_stop` is polled by the step thread before every step; once it returns True this
        submission's unfinished requests are aborted (the other submissions go on). `clock`: bill this submission's
        share of the steps to it (DeviceClock). Ids need only be unique within the submission. Raises ValueError
        as LLMEngine.make_requests does, RuntimeError when the loop is closed.
        """
        ids = [str(i) for i in range(len(prompts))] if request_ids is None else [str(r) for r in request_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("request_ids must be unique")
        key = next(self._keys)
        # Engine-wide ids from the start (two submissions may both have a row "0"): the engine keys each request's
        # logits-processor state (constraints, penalties, logprobs) by its id.
        prepared = self.engine.make_requests(prompts, sampling_params, request_ids=[f"{key}:{i}" for i in
                                                                                    range(len(ids))],
                                             use_chat_template=use_chat_template,
                                             allow_special_tokens=allow_special_tokens)
        sub = Submission(self._request_abort, key, len(prepared), time.perf_counter(), should_stop, clock,
                         [None] * len(prepared))
        requests: list[tuple[Request, int, str, ParentRequest | None]] = []
        for i, item in enumerate(prepared):
            if isinstance(item, RequestOutput):
                item.request_id = ids[i]
                sub._queue.put((i, item))
            else:
                parent = item if isinstance(item, ParentRequest) else None
                requests.extend((req, i, ids[i], parent) for req in engine_requests(item))
        if not requests:
            sub._queue.put(DONE)
            return sub
        self.start()
        self._post(("add", sub, requests))
        return sub

    # ---- the step thread -----------------------------------------------------------------------------------

    def _request_abort(self, sub: Submission) -> None:
        """Submission.abort's callback (any thread): the step thread aborts `sub`'s requests before its next step."""
        self._post(("abort", sub))

    def _post(self, message: tuple) -> None:
        with self._cv:
            if self._broken is None and not self._ended:
                self._inbox.append(message)
                self._cv.notify_all()
                return
            error = self._broken or RuntimeError("this engine loop is closed; make a new one")
        message[1]._queue.put(error)  # the loop is gone (broken, or closed while this was posted): answer at once
        message[1]._queue.put(DONE)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the loop itself broke: no submitter may wait for it forever
            log.error("engine loop stopped: %s: %s", type(e).__name__, e)
            with self._cv:
                self._closed, self._broken = True, e
                inbox, self._inbox = self._inbox, []
            self._fail_all(e, inbox)
            raise

    def _serve(self) -> None:
        try:
            self._thread_init()
        except Exception as e:  # a thread setting is not worth the loop
            log.warning("engine loop: thread_init failed: %s: %s", type(e).__name__, e)
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not engine.has_unfinished and not self._closed:
                    self._cv.wait()
                if self._closed and not self._inbox and not engine.has_unfinished:
                    self._ended = True  # under the lock: a later _post answers its submitter itself
                    return
                inbox, self._inbox = self._inbox, []
            try:
                self._handle(inbox)
                if self._aborting:
                    for sub in list(self._active.values()):
                        self._abort(sub)
                self._poll_stops()
                if engine.has_unfinished:
                    self._step()
            except BaseException as e:  # a failed step: every submission in the engine gets the error
                log.warning("engine loop: step failed (%s: %s); aborting every request in the engine",
                            type(e).__name__, e)
                self._fail_all(e, inbox)

    def _handle(self, inbox: list[tuple]) -> None:
        added: list[Request] = []
        for message in inbox:
            if message[0] == "add":
                _, sub, requests = message
                self._active[sub.key] = sub
                sub.remaining = len(requests)
                for req, index, caller_id, parent in requests:
                    self._owner[req.request_id] = (sub, index, caller_id, parent)
                    added.append(req)
            elif message[1].key in self._active:  # abort
                self._abort(message[1])
        if added:
            self.engine.add_requests(added)

    def _poll_stops(self) -> None:
        for sub in list(self._active.values()):
            if sub.should_stop is None:
                continue
            try:
                stop = sub.should_stop()
            except Exception as e:  # this submitter's check failed: stop its rows, tell it why
                sub._queue.put(e)
                stop = True
            if stop:
                self._abort(sub)

    def _abort(self, sub: Submission) -> None:
        for out in self.engine.abort_requests([rid for rid, entry in self._owner.items() if entry[0] is sub]):
            self._deliver(out)

    def _step(self) -> None:
        self.idle.step(True)
        t = time.perf_counter()
        try:
            finished = self.engine.step()
        finally:
            dt = time.perf_counter() - t
            self.idle.step(False)
        self.step_seconds += dt
        scheduled = self.engine.last_scheduled
        total = sum(n for _, n in scheduled)
        if total:
            owner = self._owner
            for req, n in scheduled:
                entry = owner.get(req.request_id)
                if entry is not None and entry[0].clock is not None:
                    entry[0].clock.share_s += dt * n / total
        for req in finished:
            self._deliver(self.engine.output_of(req, self._owner[req.request_id][0].start))

    def _deliver(self, out: RequestOutput) -> None:
        """Hand the output of a request that left the engine (finished or aborted; under its engine id) to its
        submission."""
        sub, index, caller_id, parent = self._owner.pop(out.request_id)
        sub.remaining -= 1
        # One of a prompt's n samples: the prompt's output once all n are in (as LLMEngine.generate's).
        done = out if parent is None else parent.add(out)
        if done is not None:
            done.request_id = caller_id
            for sample in done.samples or ():
                sample.request_id = caller_id
            sub._queue.put((index, done))
        if sub.remaining == 0:
            del self._active[sub.key]
            sub._queue.put(DONE)

    def _fail_all(self, error: BaseException, inbox: list[tuple] = ()) -> None:
        """Abort every request in the engine and end every submission with `error`, those of `inbox` (messages
        taken but maybe not handled) included."""
        for message in inbox:
            if message[0] == "add" and message[1].key not in self._active:
                message[1]._queue.put(error)
                message[1]._queue.put(DONE)
                ids = [req.request_id for req, _, _, _ in message[2]]
                for rid in ids:
                    self._owner.pop(rid, None)
                self.engine.abort_requests(ids)  # never queued: the engine forgets their logits-processor state
        aborted = self.engine.abort_all()
        for sub in self._active.values():
            sub._queue.put(error)
        for out in aborted:
            if out.request_id in self._owner:
                self._deliver(out)
        for sub in list(self._active.values()):  # requests not yet in the scheduler
            rest = [rid for rid, entry in self._owner.items() if entry[0] is sub]
            for rid in rest:
                del self._owner[rid]
            self.engine.abort_requests(rest)
            del self._active[sub.key]
            sub._queue.put(DONE)
