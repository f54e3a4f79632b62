"""Iteration-level scheduling: which requests run this step, and how many tokens each. Plain Python, no torch.

Sources: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative Models" (OSDI 2022) for
iteration-level scheduling; Agrawal et al., "Sarathi-Serve" (OSDI 2024) for chunked prefill under a token budget;
Kwon et al., PagedAttention (SOSP 2023) for preemption by recomputation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


class ScheduledRequest(NamedTuple):
    """One request's share of a step: feed tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)."""

    request: Request
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    """The plan of one step. `preempted` lost their blocks this step and wait to be recomputed."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        """Tokens fed to the model this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Continuous batching over a KV block pool.

    Every step: running requests first (oldest first), each asking for its remaining tokens (1 when decoding, a
    chunk of at most the leftover budget when prefilling); when the pool is full the newest running request is
    preempted (blocks freed, `num_computed_tokens` reset, back to the head of the queue) and recomputed later.
    If nothing was preempted, waiting requests are admitted while `max_num_seqs`, the token budget and the pool
    allow, starting past any prefix-cache hits; a request whose next full block another request computes in this
    step waits for the next step and takes that block from the cache. A long prompt is prefilled in chunks across
    steps.

    Args:
        kv_cache: the block tables and pool.
        max_num_seqs: most running requests.
        max_num_batched_tokens: tokens per step, prefill chunks and decodes together.
    """

    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_requests(self, requests: Iterable[Request]) -> None:
        """Queue requests in the given order (the engine sorts an offline batch before calling this)."""
        for r in requests:
            r.status = RequestStatus.WAITING
            self.waiting.append(r)

    @property
    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Never drops a request: the pool running dry preempts, it does not fail."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        pending: set[int] = set()  # hashes of the full blocks this step computes
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv_cache.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, n))
                self._add_pending(pending, req, n)
                budget -= n
                i += 1
        if not preempted:
            self._admit(scheduled, pending, budget)
        return SchedulerOutput(scheduled, preempted)

    def _admit(self, scheduled: list[ScheduledRequest], pending: set[int], budget: int) -> None:
        """Admit waiting requests in queue order while max_num_seqs, the token budget and the pool allow.

        In-batch prefix sharing (as SGLang's scheduler deprioritizes requests whose prefix another request of the
        same batch is computing): a request whose next uncached full block is one this step already computes for
        another request waits one step, then finds that block in the prefix cache instead of computing it again.
        Offline jobs send the same system prompt or template head on every row, so this saves that much prefill
        per request. At most max_num_seqs requests are passed over per step; their order in the queue is kept."""
        deferred: list[Request] = []
        while (self.waiting and len(self.running) < self.max_num_seqs and budget > 0
               and len(deferred) < self.max_num_seqs):
            req = self.waiting[0]
            hits = self.kv_cache.get_computed_blocks(req)
            if pending and self.kv_cache.enable_prefix_caching:
                hashes = self.kv_cache.block_hashes(req)
                if len(hits) < len(hashes) and hashes[len(hits)] in pending:
                    deferred.append(self.waiting.popleft())
                    continue
            n = min(req.num_tokens - len(hits) * self.kv_cache.block_size, budget)
            if self.kv_cache.allocate_slots(req, n, hits) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n))
            self._add_pending(pending, req, n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _add_pending(self, pending: set[int], req: Request, num_new_tokens: int) -> None:
        """Add the hashes of the full blocks `req` completes by computing `num_new_tokens` more tokens."""
        if not self.kv_cache.enable_prefix_caching:
            return
        bs = self.kv_cache.block_size
        first = req.num_computed_tokens // bs
        last = min((req.num_computed_tokens + num_new_tokens) // bs, (req.num_tokens - 1) // bs)
        if last > first:
            pending.update(self.kv_cache.block_hashes(req, last)[first:])

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        # Head of the queue: a preempted request resumes before new ones are admitted.
        self.waiting.appendleft(request)

    def abort_all(self) -> list[Request]:
        """Drop every waiting and running request (a spot notice: stop now). Frees their blocks, marks them
        FINISHED with finish_reason "abort", and returns them (running ones first)."""
        aborted = self.running + list(self.waiting)
        for req in aborted:
            self.kv_cache.free(req)
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
        self.running, self.waiting = [], deque()
        return aborted

    def finish(self, request: Request, reason: str) -> None:
        """Mark `request` finished with `reason` ("stop" | "length") and free its blocks."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache.free(request)
        self.running.remove(request)
