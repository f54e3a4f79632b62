"""What a step does to the logits of rows that ask for more than plain sampling: raw logprobs, logit_bias,
min_tokens, presence/frequency/repetition penalties, and the grammar bitmask of structured outputs.

The order is vLLM v1's (vllm/v1/sample/sampler.py, Sampler.forward): logprobs are taken first, from the model's raw
logits (log_softmax in fp32 before anything else touches them: vLLM's default `logprobs_mode="raw_logprobs"`; OpenAI
does not document which); then logit_bias and min_tokens (vLLM's LogitBiasLogitsProcessor and
MinTokensLogitsProcessor), then the penalties (vllm/model_executor/layers/utils.py `apply_penalties`: repetition
over prompt and output tokens, frequency and presence over output tokens), then the grammar bitmask (applied last, so
a masked token stays masked whatever the bias), and finally the sampler's temperature, top-k, top-p or argmax.

The dense ops (logit_bias, min_tokens, penalties) are engine.sample.penalties'; this module keeps the per-request
state and the grammar bitmask.

NOTE: only rows registered with `add` are touched, and a step whose batch holds none of them costs one truthiness
test (`active`): the greedy path of unconstrained jobs pays nothing per row. The work of a step is one batched op per
kind (one index_put for every bias, one scatter for every penalized row's counts; for the constrained rows one
batched xgrammar bitmask fill, one bitmask application and one batched accept, all C++); the Python per registered
row gathers its parameters. The constrained rows' share of a step's CPU time is small, the bitmask application (a
pass over [S, V] fp32 logits) its largest part (bench/README.md "Structured outputs").
A request's state (its matcher, its logprobs) follows its output tokens, which survive a KV preemption: recomputing
the prompt after a preemption neither resets nor replays the matcher.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.core.request import Request
from engine.sample.penalties import apply_bias_and_min_tokens, apply_penalties
from engine.sample.structured_output import StructuredOutputManager, grammar_of
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.core.scheduler import ScheduledRequest

# How long `add` waits for a constraint's compile before it lets the row wait in the queue instead (seconds): most
# compiles (and every constraint that does not parse) finish within it, so their errors are error rows before any work.
COMPILE_WAIT_S = 0.05


def bitmask_backend(device: torch.device) -> str:
    """xgrammar's apply_token_bitmask_inplace backend for logits on `device`: "cpu" (its C++ loop) on the CPU;
    on CUDA "triton" (xgrammar's default device kernel) when Triton imports, else "torch_native" (torch ops, still on
    the device). Raises ValueError for another device type (name it: the engine runs on cpu and cuda)."""
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"structured outputs run on cpu or cuda logits, not {device.type}; use device cpu or cuda")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch_native"
    return "triton"


def allocate_bitmask(rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The host token bitmask (xgrammar's layout: int32 [rows, ceil(vocab_size / 32)], bit j of word w = token
    32 w + j allowed), pinned when the logits live on CUDA so the per-step copy to the device is asynchronous."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(rows, vocab_size)
    return bitmask.pin_memory() if device.type == "cuda" else bitmask


class RawLogprob(NamedTuple):
    """One output token's log probability and the top alternatives (token id, logprob), most likely first; logprobs
    are natural-log probabilities from the raw logits (fp32). The engine adds the tokens' text
    (engine.outputs.TokenLogprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RowState:
    """Per-request state kept across steps: its grammar matcher (None when unconstrained or while its grammar
    compiles), its logprobs so far (None when not asked for), whether the matcher refused a token (never expected: the
    mask allows only accepted tokens), the compile it waits for (`compiling`), and the compile's error when its
    constraint turned out not to compile after the row was queued (`error`: the row ends at once as an error row)."""

    params: SamplingParams
    matcher: Any = None
    logprobs: list[RawLogprob] | None = None
    rejected: bool = False
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
    compiling: Future | None = None
    error: str | None = None

    @property
    def valid(self) -> bool | None:
        """For a constrained request: True when its output completed the grammar (the matcher accepted an end token);
        None when unconstrained."""
        if self.error is not None:
            return False
        if self.matcher is None:
            return None
        return not self.rejected and self.matcher.is_terminated()


class _Pending(NamedTuple):
    """What `record` needs after the sampler picked a step's tokens."""

    lp_rows: list[int]  # rows of the step's logits with logprobs
    lp_states: list[RowState]
    raw: torch.Tensor | None  # fp32 [L, V] raw logprobs of those rows
    top: tuple[torch.Tensor, torch.Tensor] | None  # (values fp32 [L, K], ids int64 [L, K]) of the largest K asked
    matched: list[tuple[int, RowState]]  # (row, state) of constrained rows


class LogitsProcessors:
    """The registered requests' states and the per-step logits work (module docstring).

    Args:
        structured: compiles constraints (None: no tokenizer, so a constrained request is refused).
        vocab_size: the logits' width.
        eos_token_ids: the model's end-of-sequence ids (masked by min_tokens).
    """

    def __init__(self, structured: StructuredOutputManager | None, vocab_size: int, eos_token_ids: list[int],
                 compile_wait_s: float = COMPILE_WAIT_S) -> None:
        self.structured = structured
        self.compile_wait_s = compile_wait_s
        self._num_compiling = 0  # registered requests whose grammar still compiles
        self._count_lock = threading.Lock()  # submitters `add` while the step thread resolves
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.states: dict[str, RowState] = {}
        self._bitmask: torch.Tensor | None = None  # int32 [rows, ceil(V / 32)] on the host (pinned on CUDA)
        self._device_bitmask: torch.Tensor | None = None  # its copy on the logits' device (None on CPU)
        self._batch_matcher: Any = None

    @property
    def _batch(self) -> Any:
        """xgrammar's BatchGrammarMatcher (one thread: the step's other work already uses the cores)."""
        if self._batch_matcher is None:
            import xgrammar as xgr

            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        return self._batch_matcher

    @property
    def active(self) -> bool:
        """True while any registered request is unfinished."""
        return bool(self.states)

    def any_registered(self, scheduled: Iterable[ScheduledRequest]) -> bool:
        """Whether any request of a step's plan has a logits processor registered (its step must run
        synchronously, engine.llm_engine.LLMEngine.step)."""
        states = self.states
        return any(s.request.request_id in states for s in scheduled)

    def add(self, request: Request) -> None:
        """Register a request whose params need logits processing (SamplingParams.needs_logits_processing; others
        are ignored). Compiles its constraint (cached per distinct constraint). Raises ValueError when the constraint
        does not compile, the engine has no tokenizer to compile it against, or a logit_bias id is outside the
        vocabulary. A compile that takes longer than `compile_wait_s` goes on in the background: the request is
        registered as compiling, and `ready` holds it back from the batch until its grammar is done."""
        sp = request.sampling_params
        if not sp.needs_logits_processing:
            return
        outside = [t for t, _ in sp.logit_bias if t >= self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {self.vocab_size}); "
                             "use this model's token ids")
        matcher = compiling = None
        if sp.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured outputs need the model's tokenizer; this engine has none")
            compiling = self.structured.compile_async(sp.structured_outputs)
            try:
                compiling.result(timeout=self.compile_wait_s)
            except concurrent.futures.TimeoutError:
                pass
            else:
                matcher, compiling = self._matcher(compiling), None  # a compile error raises here: an error row
        stop_ids = tuple(dict.fromkeys((*(() if sp.ignore_eos else self.eos_token_ids), *sp.stop_token_ids)))
        if request.request_id in self.states:
            self.pop(request.request_id)
        self.states[request.request_id] = RowState(sp, matcher, [] if sp.logprobs is not None else None,
                                                   stop_ids=stop_ids, compiling=compiling)
        if compiling is not None:
            self._count(1)

    def _count(self, delta: int) -> None:
        with self._count_lock:
            self._num_compiling += delta

    @staticmethod
    def _matcher(compiled: Future) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(grammar_of(compiled))

    def ready(self, request: Request) -> bool:
        """Whether `request` may join the batch: False while its grammar compiles (engine.core.scheduler holds it back
        and
        admits the rows behind it). Once the compile is done it makes the request's matcher, or, when the constraint
        did not compile, records the error (the row then ends at its first step as an error row). O(1) while no
        grammar compiles."""
        if not self._num_compiling:
            return True
        st = self.states.get(request.request_id)
        if st is None or st.compiling is None:
            return True
        if not st.compiling.done():
            return False
        self._resolve(st)
        return True

    def _resolve(self, st: RowState) -> None:
        """The compile `st` waited for is done (or is waited for now): its matcher, or its error."""
        try:
            st.matcher = self._matcher(st.compiling)
        except ValueError as e:
            st.error = str(e)
        st.compiling = None
        self._count(-1)

    def wait_for_compiles(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` seconds for any registered request's grammar compile to finish (the scheduler had
        nothing else to run). Returns False when no compile is pending."""
        pending = [st.compiling for st in list(self.states.values()) if st.compiling is not None]
        if not pending:
            return False
        concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
        return True

    def pop(self, request_id: str) -> RowState | None:
        """Forget a finished request; its state, or None when it was not registered."""
        st = self.states.pop(request_id, None)
        if st is not None and st.compiling is not None:
            self._count(-1)
        return st

    def clear(self) -> None:
        """Forget every request (an aborted batch)."""
        self.states.clear()
        with self._count_lock:
            self._num_compiling = 0

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, _Pending | None]:
        """Process the logits [S, V] of a step whose rows sample `requests` (in order). Returns the logits to sample
        from (fp32 when any row was processed: vLLM's sampler works in fp32 too; else the input unchanged) and what
        `record` needs, or None when no row of this step is registered."""
        rows: list[int] = []
        states: list[RowState] = []
        for i, r in enumerate(requests):
            st = self.states.get(r.request_id)
            if st is not None:
                rows.append(i)
                states.append(st)
        if not rows:
            return logits, None
        for st in states:
            if st.compiling is not None:  # scheduled without `ready` (a scheduler that does not ask): wait here
                self._resolve(st)
        logits = logits.float()
        device = logits.device
        lp = [(i, st) for i, st in zip(rows, states, strict=True) if st.logprobs is not None]
        raw = top = None
        if lp:
            raw = torch.log_softmax(logits[torch.tensor([i for i, _ in lp], device=device)], dim=-1)
            k = max(st.params.logprobs or 0 for _, st in lp)
            if k:
                top = raw.topk(k, dim=-1)
        apply_bias_and_min_tokens(logits, [(i, st.params, st.stop_ids) for i, st in zip(rows, states, strict=True)],
                                  requests, self.vocab_size)
        apply_penalties(logits, [(i, st.params) for i, st in zip(rows, states, strict=True)], requests,
                        self.vocab_size)
        failed = [(i, st) for i, st in zip(rows, states, strict=True) if st.error is not None]
        for i, st in failed:  # its constraint did not compile: end it now (only a stop id left), reported as an error
            logits[i] = float("-inf")
            logits[i, (st.stop_ids or self.eos_token_ids or (0,))[0]] = 0.0
        matched = [(i, st) for i, st in zip(rows, states, strict=True) if st.matcher is not None]
        if matched:
            self._apply_bitmask(logits, matched)
        return logits, _Pending([i for i, _ in lp], [st for _, st in lp], raw, top, matched)

    def _apply_bitmask(self, logits: torch.Tensor, matched: list[tuple[int, RowState]]) -> None:
        """Fill the bitmask rows of every constrained row in one batched xgrammar call (C++, no Python per row) and
        mask their logits in one call. On CUDA the bitmask is built on the host (pinned), copied to the device once
        per step and applied there (xgrammar's Triton kernel): the logits never leave the device."""
        import xgrammar as xgr

        s = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < s:
            self._bitmask = allocate_bitmask(max(s, 64), self.vocab_size, logits.device)
            self._device_bitmask = (None if logits.device.type == "cpu" else
                                    torch.empty_like(self._bitmask, device=logits.device))
        rows = [i for i, _ in matched]
        indices = None if len(rows) == s else rows  # every row constrained (rows are distinct and in order)
        self._batch.batch_fill_next_token_bitmask([st.matcher for _, st in matched], self._bitmask, rows)
        bitmask = self._bitmask[:s]
        if self._device_bitmask is not None:
            # Safe to reuse the pinned host buffer next step: sampling copies the tokens to the host (a sync) first.
            bitmask = self._device_bitmask[:s].copy_(bitmask, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices,
                                        backend=bitmask_backend(logits.device))

    def record(self, pending: _Pending, tokens: list[int]) -> None:
        """After sampling: append each logprobs row's chosen-token logprob and top-k (one device->host copy), and
        advance each constrained row's matcher by its token."""
        if pending.raw is not None:
            chosen = torch.tensor([tokens[i] for i in pending.lp_rows], device=pending.raw.device)
            values = pending.raw.gather(1, chosen[:, None])[:, 0].tolist()
            top_v, top_i = (pending.top[0].tolist(), pending.top[1].tolist()) if pending.top is not None else ([], [])
            for j, st in enumerate(pending.lp_states):
                k = st.params.logprobs or 0
                alts = list(zip(top_i[j][:k], top_v[j][:k], strict=True)) if k else []
                st.logprobs.append(RawLogprob(tokens[pending.lp_rows[j]], values[j], alts))
        if pending.matched:
            import xgrammar as xgr

            accepted = xgr.BatchGrammarMatcher.batch_accept_token([st.matcher for _, st in pending.matched],
                                                                   [tokens[i] for i, _ in pending.matched])
            for (_, st), ok in zip(pending.matched, accepted, strict=True):
                if not ok:
                    st.rejected = True
