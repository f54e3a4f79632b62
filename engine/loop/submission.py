"""A submission to the engine loop (engine.loop.engine_loop.EngineLoop): one submitter's batch, iterated in the
submitter's thread for its outputs as they finish. The loop hands each submission the one thing it may ask of the
loop (`request_abort`), so this module knows nothing of the loop; a submitter's bill is engine.loop.clock's."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.loop.clock import DeviceClock
from engine.outputs import RequestOutput

DONE = object()  # put on a submission's queue by the step thread: every output delivered


@dataclass(eq=False)
class Submission:
    """One submitter's batch in an EngineLoop: iterate it (in the submitter's thread) for (index, output) pairs as
    requests finish; `results()` for every output in submission order.

    Outputs: one per prompt; error outputs (prompts that cannot run) come first; an aborted request (its
    `should_stop` said stop, or `abort()`) comes back with finish_reason "abort" and no output tokens. Iterating
    raises the exception of a failed engine step (every request of the loop is then aborted) or of `should_stop`.

    Made by EngineLoop.submit: `request_abort(submission)` is the loop's callback that queues the abort of a
    submission's requests for its step thread (any thread may call it).
    """

    request_abort: Callable[[Submission], None]
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
        self.request_abort(self)

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
