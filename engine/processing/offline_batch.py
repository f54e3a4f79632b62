"""The offline batch of LLMEngine.generate: every prompt's requests queued up front, stepped to the end, and the
outputs in the order of the prompts. It drives the engine through its step API only (make_requests, add_requests,
step, output_of, abort_all), as engine.loop.engine_loop.EngineLoop does for requests that come over time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from engine.core.request import Request
from engine.outputs import RequestOutput
from engine.processing.parallel_sampling import ParentRequest, engine_requests
from engine.sampling_params import SamplingParams
from engine.text.prompts import Prompt


class StepEngine(Protocol):
    """The part of engine.llm_engine.LLMEngine that `generate_batch` uses (documented there)."""

    @property
    def has_unfinished(self) -> bool: ...

    def make_requests(self, prompts: Sequence[Prompt],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                      request_ids: Sequence[str] | None = None, use_chat_template: bool = True,
                      allow_special_tokens: bool = False) -> list[Request | ParentRequest | RequestOutput]: ...

    def add_requests(self, requests: Sequence[Request]) -> None: ...

    def step(self) -> Iterable[Request]: ...

    def output_of(self, req: Request, start: float) -> RequestOutput: ...

    def abort_all(self) -> list[RequestOutput]: ...


def generate_batch(
    engine: StepEngine,
    prompts: Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    request_ids: Sequence[str] | None = None,
    use_chat_template: bool = True,
    allow_special_tokens: bool = False,
    on_output: Callable[[RequestOutput], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[RequestOutput]:
    """`engine.generate(...)`: generate for all prompts as one continuous batch; outputs come back in the order of
    `prompts`.

    Offline we know every request up front: they are admitted longest first (prompt + max_tokens; the LPT
    rule, Graham 1969), so the long ones do not form a lonely tail, then refilled at iteration level.
    Text prompts go through the model's chat template unless `use_chat_template` is False; user text (prompts,
    message contents) is encoded as text, so a control token spelt in it (`<|im_end|>`) stays plain characters,
    unless `allow_special_tokens` (raw control: then it is the control token; engine.text.tokenizer).
    A vision-language model's prompts may carry images: {"prompt" | "messages": ..., "images": [...]}, or messages
    with OpenAI image_url / HF image content parts (engine.multimodal documents the forms); a text-only model given
    one raises ValueError before any work, and an unreadable image or images that do not match their placeholders
    make that prompt's error output.
    A prompt that cannot run (empty, malformed, or longer than max_model_len - 1 tokens) gets
    finish_reason="error" and an `error` message; the others go on. `on_output` is called once per request as
    soon as it finishes (for progress and checkpoints). `should_stop` is polled before every step; once it
    returns True (a spot-preemption notice) no further step runs and every unfinished request comes back with
    finish_reason="abort" and no output tokens (its blocks freed; `on_output` is not called for it), so the
    caller can commit what finished and leave the rest for a later attempt. A request with n > 1 runs as n
    requests on the same prompt (the children of a ParentRequest: engine.processing.parallel_sampling) and
    comes back, once all n finished, as one output with `samples` (its id any text: no id is parsed back); a
    structured output whose constraint does not compile is an error output like a bad prompt.
    An exception from a step or from `on_output` aborts every unfinished request (blocks freed) and propagates.
    Raises ValueError when the lengths of prompts, params and ids differ; RuntimeError while an EngineLoop runs
    this engine.
    """
    if engine.has_unfinished:
        raise RuntimeError("generate called while this engine runs other requests (an engine.loop.engine_loop."
                           "EngineLoop owns it): submit to that loop instead")
    start = time.perf_counter()
    prepared = engine.make_requests(prompts, sampling_params, request_ids=request_ids,
                                    use_chat_template=use_chat_template, allow_special_tokens=allow_special_tokens)
    outputs: list[RequestOutput | None] = [None] * len(prepared)
    owner: dict[str, tuple[int, ParentRequest | None]] = {}  # engine request id -> (prompt index, its parent)
    requests: list[Request] = []
    for i, item in enumerate(prepared):
        if isinstance(item, RequestOutput):
            outputs[i] = item
            if on_output:
                on_output(item)
            continue
        children = engine_requests(item)
        requests.extend(children)
        parent = item if isinstance(item, ParentRequest) else None
        owner.update((req.request_id, (i, parent)) for req in children)
    engine.add_requests(requests)

    def prompt_output(out: RequestOutput) -> tuple[int, RequestOutput | None]:
        """The prompt index of a request's output and the prompt's output: this one, or for one of n samples the
        joined output once all n are in (None before)."""
        i, parent = owner[out.request_id]
        return i, out if parent is None else parent.add(out)

    try:
        while engine.has_unfinished:
            if should_stop is not None and should_stop():
                for aborted in engine.abort_all():
                    i, out = prompt_output(aborted)
                    if out is not None:
                        outputs[i] = out
                break
            for req in engine.step():
                i, out = prompt_output(engine.output_of(req, start))
                if out is None:
                    continue
                outputs[i] = out
                if on_output:
                    on_output(out)
    except BaseException:
        # A failed step or callback: leave the engine as it was before the call (no request left queued, every
        # block freed), so the next generate on this long-lived engine starts clean.
        engine.abort_all()
        raise
    return [o for o in outputs if o is not None]
