"""Iteration-level scheduling: which requests run this step, how many tokens each, and what a step's output does to
them. Plain Python, no torch. The scheduler owns request state: only it changes a request's counters, status and
finish reason (vLLM v1's shape: `schedule()` plans a step, `update_from_output()` applies its sampled tokens).

Sources: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative Models" (OSDI 2022) for
iteration-level scheduling; Agrawal et al., "Sarathi-Serve" (OSDI 2024) for chunked prefill under a token budget;
Kwon et al., PagedAttention (SOSP 2023) for preemption by recomputation.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import NamedTuple

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.stop import check_stop
from engine.multimodal.image_attention import whole_image_chunk


class ScheduledRequest(NamedTuple):
    """One request's share of a step: feed tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)."""

    request: Request
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    """The plan of one step: the requests that run and how many tokens each feeds."""

    scheduled: list[ScheduledRequest]


class Scheduler:
    """Continuous batching over a KV block pool.

    Every step: running requests first (oldest first), each asking for its remaining tokens (1 when decoding, a
    chunk of at most the leftover budget when prefilling); when the pool is full the newest running request is
    preempted (blocks freed, `num_computed_tokens` reset, back to the head of the queue) and recomputed later.
    If nothing was preempted, waiting requests are admitted while `max_num_seqs`, the token budget and the pool
    allow, starting past any prefix-cache hits; a request whose next full block another request computes in this
    step waits for the next step and takes that block from the cache. A long prompt is prefilled in chunks across
    steps. After the model ran, `update_from_output` advances the counters, appends the sampled tokens, and
    finishes and frees the requests that hit a stop condition.

    Args:
        kv_cache_manager: the block tables and pool.
        max_num_seqs: most running requests.
        max_num_batched_tokens: tokens per step, prefill chunks and decodes together.
        eos_token_id: the model's end-of-sequence token (None: none).
        eos_token_ids: every other token id that ends a sequence (ModelConfig.eos_token_ids).
        max_model_len: most tokens (prompt + output) of a request; reaching it finishes the request ("length").
        longrope_original: LongRoPE's original context O when the model keeps both factor sets (RotaryEmbedding.
            long_from): a request admitted at O tokens or fewer (its keys rotated by the short factors) whose next
            token would sit at position O or later is recomputed from position 0 with the long ones, as HF
            transformers' Phi-3 `prepare_inputs_for_generation` drops its cache there. None: never.
        whole_images: a prefill chunk never ends inside an image's placeholders (a model whose placeholders of one
            image attend to each other: ModelBase.bidirectional_images; engine.multimodal.image_attention); a
            request whose next image does not fit the step's leftover budget waits for a later step.
    Raises ValueError when a limit is below 1.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, *,
                 eos_token_id: int | None = None, max_model_len: int = 1 << 62,
                 eos_token_ids: Collection[int] = (), longrope_original: int | None = None,
                 whole_images: bool = False) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.longrope_original = longrope_original
        self.whole_images = whole_images
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Whether a waiting request may join the batch (engine.sample.logits_processors.LogitsProcessors.ready: False
        # while
        # its grammar compiles); a held request keeps its place and the requests behind it are admitted.
        self.admission_check: Callable[[Request], bool] | None = None

    def add_requests(self, requests: Iterable[Request], key: Callable[[Request], int] | None = None) -> None:
        """Queue requests in the given order (the engine sorts an offline batch before calling this), or, given a
        sort `key`, merge them into the waiting queue so that the requests never admitted are ordered by `key`
        (stable; e.g. LPT across several submissions to one running engine) behind the preempted ones, which keep
        the head of the queue. May be called between any two steps."""
        new = list(requests)
        for r in new:
            r.status = RequestStatus.WAITING
        if key is None:
            self.waiting.extend(new)
            return
        resumed = [r for r in self.waiting if r.num_preemptions]
        fresh = sorted([r for r in self.waiting if not r.num_preemptions] + new, key=key)
        self.waiting = deque(resumed + fresh)

    @property
    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Never drops a request: the pool running dry preempts, it does not fail."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        pending: set[int] = set()  # hashes of the full blocks this step computes
        kv = self.kv_cache_manager
        allocate, bs, caching, tables = kv.allocate_slots, kv.block_size, kv.enable_prefix_caching, kv.block_tables
        # NOTE: tuple.__new__ builds the NamedTuple without its Python-level __new__ (cheaper a row: bench/README.md
        # "Figures once quoted in engine/'s docstrings").
        new, scheduled_request = tuple.__new__, ScheduledRequest
        running = self.running
        original = self.longrope_original
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.ends_at_pending_token:  # asynchronous steps: its token on the device ends it (length)
                i += 1
                continue
            if original is not None and req.kv_start_len <= original < len(req.all_token_ids):
                self._preempt(running.pop(i))  # its short-factor keys are recomputed with the long factors
                continue
            done = req.num_computed_tokens
            n = len(req.all_token_ids) - done
            if n > budget:
                n = budget
                if self.whole_images and req.mm_items:
                    n = whole_image_chunk(req.mm_items, done, n)
                    if not n:  # its next image waits for a step with room for it
                        i += 1
                        continue
            table = tables.get(req.request_id)
            # allocate_slots' decode path inline (most steps the last block still has room), the call otherwise.
            if table is None or done + n > len(table) * bs:
                while allocate(req, n) is None:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:  # preempted itself: nothing left to run after it
                    continue
            scheduled.append(new(scheduled_request, (req, n)))
            if caching and (done + n) // bs != done // bs:  # the step completes a full block
                self._add_pending(pending, req, n)
            budget -= n
            i += 1
        if not preempted:
            self._admit(scheduled, pending, budget)
        return SchedulerOutput(scheduled)

    def update_from_output(self, output: SchedulerOutput, sampled: Sequence[tuple[Request, int]],
                           now: float | None = None) -> list[Request]:
        """Apply a step's results: every scheduled request's `num_new_tokens` are now in the KV cache (their full
        blocks registered for prefix caching); each (request, token) in `sampled` (the requests whose step reached
        their last token) gets its token appended, its first-token time set, and is finished and freed when
        `check_stop` says so. `now`: time.perf_counter() seconds of the step's end (default: now).
        Returns the requests that finished in this step."""
        self.advance(output)
        return self._take_tokens(sampled, time.perf_counter() if now is None else now, pending=False)

    def advance(self, output: SchedulerOutput) -> None:
        """The first half of `update_from_output`, which needs no sampled token: every scheduled request still
        running has its `num_new_tokens` in the KV cache (num_computed_tokens moves on; the full blocks it
        completed are registered for prefix caching). Requests that finished or were aborted are skipped."""
        kv = self.kv_cache_manager
        bs = kv.block_size
        caching = kv.enable_prefix_caching
        running = RequestStatus.RUNNING
        for req, n in output.scheduled:
            if req.status is not running:
                continue
            done = req.num_computed_tokens
            req.num_computed_tokens = done + n
            # Only a step that fills a block has a block to register.
            if caching and (done + n) // bs != done // bs:
                kv.cache_full_blocks(req)

    def hold_pending_tokens(self, sampling: Sequence[Request]) -> list[Request]:
        """Asynchronous steps: the requests of `sampling` (a launched step's sampled requests, in the order of its
        token tensor) that still run get a placeholder for the token they will receive, -1 - (its index in the
        tensor), as the last of their all_token_ids, so `schedule` gives them their next step (whose input id the
        model runner takes from the tensor on the device) before the token is on the host. A placeholder that
        reaches the request's length limit (max_tokens, max_model_len) marks it `ends_at_pending_token`. Returns the
        requests that hold one (empty: nothing to wait for)."""
        held = []
        max_len = self.max_model_len
        running = RequestStatus.RUNNING
        for i, req in enumerate(sampling):
            if req.status is not running:
                continue
            tokens = req.all_token_ids
            tokens.append(-1 - i)
            num = len(tokens)
            if num >= req.max_num_tokens or num >= max_len:
                req.ends_at_pending_token = True
            held.append(req)
        return held

    def take_pending_tokens(self, sampling: Sequence[Request], tokens: Sequence[int],
                            now: float | None = None) -> list[Request]:
        """Asynchronous steps: the tokens of a launched step are on the host. Each request of `sampling` (the
        step's sampled requests, in the order of `tokens`) that is not finished (running, or preempted since and
        waiting) gets its placeholder (`hold_pending_tokens`) replaced by its token and the stop checks of
        `update_from_output`; returns the requests that finished. Aborted requests are skipped."""
        return self._take_tokens(zip(sampling, tokens, strict=True), time.perf_counter() if now is None else now,
                                 pending=True)

    def _take_tokens(self, sampled: Iterable[tuple[Request, int]], now: float, *, pending: bool) -> list[Request]:
        """Append (or with `pending`, put in place of the placeholder) each request's sampled token, set its
        first-token time, and finish and free the requests that hit a stop condition; returns them."""
        finished = []
        eos, eos_ids, max_len = self.eos_token_id, self.eos_token_ids, self.max_model_len
        any_eos = eos_ids if eos is None else eos_ids | {eos}  # per step: the ids may be reassigned
        done_status = RequestStatus.FINISHED
        preempted = False
        for req, token in sampled:
            tokens = req.all_token_ids
            if pending:
                if req.status is done_status:  # aborted while its step ran
                    continue
                tokens[-1] = token
            else:
                tokens.append(token)
            # Request.append_output_token inline (one call less per row per step).
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            num = len(tokens)
            # check_stop only where it can stop the request: an end-of-sequence token, a row with stop strings or
            # stop ids, or the length limits (most rows of most steps: four tests, no call).
            if token in any_eos or req.has_stop_checks or num >= req.max_num_tokens or num >= max_len:
                reason = check_stop(req, eos, max_len, eos_ids)
                if reason is not None:
                    preempted |= req.status is RequestStatus.WAITING
                    req.finish_time = now
                    self._finish(req, reason)
                    finished.append(req)
        if finished:
            # NOTE: one pass per step, not a list.remove per finished request (O(batch) each).
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
            if preempted:  # a request preempted while its last token was on the device: it leaves the queue
                self.waiting = deque(r for r in self.waiting if r.status is not done_status)
        return finished

    def abort_all(self) -> list[Request]:
        """Drop every waiting and running request (a spot notice: stop now). Frees their blocks, marks them
        FINISHED with finish_reason "abort", and returns them (running ones first)."""
        aborted = self.running + list(self.waiting)
        for req in aborted:
            self.kv_cache_manager.free(req)
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
        self.running, self.waiting = [], deque()
        return aborted

    def abort_requests(self, request_ids: Collection[str]) -> list[Request]:
        """Drop the waiting and running requests whose ids are in `request_ids` (one caller of a shared engine
        stops; the others go on). Frees their blocks, marks them FINISHED with finish_reason "abort", and returns
        them. Ids not in the scheduler (finished already) are ignored."""
        ids = request_ids if isinstance(request_ids, (set, frozenset, dict)) else set(request_ids)
        aborted = [r for r in self.running if r.request_id in ids] + [r for r in self.waiting if r.request_id in ids]
        if not aborted:
            return []
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for req in aborted:
            self.kv_cache_manager.free(req)
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
        return aborted

    def _admit(self, scheduled: list[ScheduledRequest], pending: set[int], budget: int) -> None:
        """Admit waiting requests in queue order while max_num_seqs, the token budget and the pool allow.

        In-batch prefix sharing (as SGLang's scheduler deprioritizes requests whose prefix another request of the
        same batch is computing): a request whose next uncached full block is one this step already computes for
        another request waits one step, then finds that block in the prefix cache instead of computing it again.
        Offline jobs send the same system prompt or template head on every row, so this saves that much prefill
        per request. At most max_num_seqs requests are passed over per step; their order in the queue is kept."""
        kv = self.kv_cache_manager
        deferred: list[Request] = []
        held = 0  # of them, waiting for their grammar (not counted against max_num_seqs passes)
        check = self.admission_check
        while (self.waiting and len(self.running) < self.max_num_seqs and budget > 0
               and len(deferred) - held < self.max_num_seqs):
            req = self.waiting[0]
            if check is not None and not check(req):
                deferred.append(self.waiting.popleft())
                held += 1
                continue
            req.kv_start_len = req.num_tokens  # before the lookup: the prefix cache's salt may read it
            hits = kv.get_computed_blocks(req)
            if pending and kv.enable_prefix_caching:
                hashes = kv.block_hashes(req)
                if len(hits) < len(hashes) and hashes[len(hits)] in pending:
                    deferred.append(self.waiting.popleft())
                    continue
            n = min(req.num_tokens - len(hits) * kv.block_size, budget)
            if self.whole_images and req.mm_items and n == budget:
                n = whole_image_chunk(req.mm_items, len(hits) * kv.block_size, n)
            if not n or kv.allocate_slots(req, n, hits) is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens += len(hits) * kv.block_size
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n))
            self._add_pending(pending, req, n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _add_pending(self, pending: set[int], req: Request, num_new_tokens: int) -> None:
        """Add the hashes of the full blocks `req` completes by computing `num_new_tokens` more tokens."""
        kv = self.kv_cache_manager
        if not kv.enable_prefix_caching:
            return
        bs = kv.block_size
        first = req.num_computed_tokens // bs
        last = min((req.num_computed_tokens + num_new_tokens) // bs, (req.num_tokens - 1) // bs)
        if last > first:
            pending.update(kv.block_hashes(req, last)[first:])

    def _preempt(self, request: Request) -> None:
        """The one place a running request loses its blocks: back to the head of the queue, to be recomputed."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        # Head of the queue: a preempted request resumes before new ones are admitted.
        self.waiting.appendleft(request)

    def _finish(self, request: Request, reason: str) -> None:
        """Mark `request` finished and free its blocks; the caller drops it from `running` (update_from_output
        does so once per step for all the requests that finished in it)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache_manager.free(request)
