"""Requests into outputs: the RequestOutput of a finished or aborted request (text, finish_reason, times, logprobs
with each token's text, a constraint's verdict); a prompt's n samples are joined by its parent request
(engine.processing.parallel_sampling). The counterpart of engine.processing.request_builder; engine.llm_engine.
LLMEngine and the engine loop's step thread call it."""

from __future__ import annotations

from engine.core.request import Request
from engine.outputs import RequestOutput, TokenLogprob, TopLogprob
from engine.sample.logits_processors import LogitsProcessors, RowState
from engine.text.tokenizer import Tokenizer


class OutputBuilder:
    """Makes the outputs of an engine's requests.

    Args:
        tokenizer: the engine's tokenizer, or None (random weights: outputs carry no text).
        logits_processors: the engine's logits-processor state; a finished request's state (logprobs, a
            constraint's verdict) is taken out of it.
        max_model_len: the engine's limit of prompt + output tokens per request (a request it cut gets a note).
    """

    def __init__(self, tokenizer: Tokenizer | None, logits_processors: LogitsProcessors, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.logits_processors = logits_processors
        self.max_model_len = max_model_len
        self._token_text: dict[int, str] = {}

    def finished(self, req: Request, start: float) -> RequestOutput:
        """The RequestOutput of a finished request (its logits-processor state forgotten); ttft_s and latency_s
        count from `start` (time.perf_counter() seconds). A request whose constraint failed to compile after it
        was queued is an error output."""
        text = req.detokenizer.finish(req.output_token_ids) if req.detokenizer is not None else ""
        state = self.logits_processors.pop(req.request_id) if self.logits_processors.active else None
        if state is not None and state.error is not None:
            return RequestOutput(req.request_id, req.prompt_token_ids, [], "", "error", error=state.error,
                                 num_preemptions=req.num_preemptions)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
            text=text, finish_reason=req.finish_reason or "length", num_preemptions=req.num_preemptions,
            ttft_s=None if req.first_token_time is None else req.first_token_time - start,
            latency_s=None if req.finish_time is None else req.finish_time - start,
            logprobs=self._logprobs(state), valid=None if state is None else state.valid, note=self._cut_note(req))

    def _cut_note(self, req: Request) -> str | None:
        """The note of a request that stopped at max_model_len before its max_tokens (None for any other)."""
        max_tokens, prompt = req.sampling_params.max_tokens, req.num_prompt_tokens
        if req.finish_reason != "length" or len(req.output_token_ids) >= max_tokens or \
                prompt + len(req.output_token_ids) < self.max_model_len:
            return None
        return (f"max_tokens {max_tokens} was cut to {self.max_model_len - prompt}: the prompt's {prompt} tokens "
                f"and the output fill max_model_len {self.max_model_len} (--max-model-len, at most the model's "
                "context)")

    @staticmethod
    def aborted(req: Request) -> RequestOutput:
        """The output of a request stopped before it finished: no output tokens, finish_reason "abort"."""
        return RequestOutput(req.request_id, req.prompt_token_ids, [], "", "abort",
                             num_preemptions=req.num_preemptions)

    def _logprobs(self, state: RowState | None) -> list[TokenLogprob] | None:
        """A request's raw logprobs with each token's text (decoded alone, cached per token id)."""
        if state is None or state.logprobs is None:
            return None

        def text(t: int) -> str:
            found = self._token_text.get(t)
            if found is None:
                found = self.tokenizer.decode([t], skip_special_tokens=False) if self.tokenizer is not None else ""
                self._token_text[t] = found
            return found

        return [TokenLogprob(r.token_id, text(r.token_id), r.logprob, [TopLogprob(t, text(t), lp) for t, lp in r.top])
                for r in state.logprobs]

