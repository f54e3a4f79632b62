"""What each engine step ran: a batch-size histogram and, for benchmarks, a per-step trace.

Recorded by LLMEngine.step at a cost of a few list/array updates per step (no per-row work).
"""

from __future__ import annotations

from array import array

# The trace keeps at most this many steps (8 bytes each: 8 MiB), then stops growing; the histograms go on.
MAX_TRACE_STEPS = 1 << 20


class StepStats:
    """Per-step batch sizes of one engine.

    Attributes:
        batch_sizes: batch_sizes[n] = steps that ran n requests (decodes and prefill chunks together).
        batch_sizes_waiting: the same, counting only steps after which requests were still waiting for admission.
        num_added: requests queued in the engine so far (every generate call and engine-loop submission).
        trace_batch: the batch size of each step (the first MAX_TRACE_STEPS steps).
        trace_admitted: requests admitted at least once by the end of each step (num_added - waiting); with the
            job's total row count it says how many rows were not yet admitted at each step.
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.batch_sizes = [0] * (max_num_seqs + 1)
        self.batch_sizes_waiting = [0] * (max_num_seqs + 1)
        self.num_added = 0
        self.trace_batch = array("I")
        self.trace_admitted = array("I")

    def record(self, batch_size: int, num_waiting: int) -> None:
        """Count one step of `batch_size` requests after which `num_waiting` requests wait for admission."""
        self.batch_sizes[batch_size] += 1
        if num_waiting:
            self.batch_sizes_waiting[batch_size] += 1
        if len(self.trace_batch) < MAX_TRACE_STEPS:
            self.trace_batch.append(batch_size)
            self.trace_admitted.append(max(self.num_added - num_waiting, 0))

    @property
    def num_steps(self) -> int:
        """Steps recorded."""
        return sum(self.batch_sizes)

    def histogram(self, *, waiting_only: bool = False) -> dict[int, int]:
        """{batch size: steps} for the sizes that occurred (`waiting_only`: steps with requests left waiting)."""
        counts = self.batch_sizes_waiting if waiting_only else self.batch_sizes
        return {n: c for n, c in enumerate(counts) if c}

    def reset(self) -> None:
        """Forget every step recorded (e.g. between two benchmark runs on one engine)."""
        self.__init__(len(self.batch_sizes) - 1)  # type: ignore[misc]
