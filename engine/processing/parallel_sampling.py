"""A prompt's n > 1 samples (SamplingParams.n): one parent request that fans out into n child requests and gathers
their outputs into one RequestOutput, as vLLM v1's ParentRequest (vllm/v1/engine/parallel_sampling.py). The parent
holds its children and knows each by the id it gave it: no request id is ever parsed back, so a caller's id may be
any text."""

from __future__ import annotations

import dataclasses

from engine.core.request import Request
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

# Between a prompt's id and a sample's index in its children's engine ids: readable in logs, never parsed.
CHILD_SEP = "\x1f"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling params of sample `index` of a request with `params`: n=1 and, when seeded, seed + index (vLLM's
    rule for parallel sampling: sample j of seed s draws as the single request of seed s + j)."""
    seed = None if params.seed is None else (params.seed + index) % (1 << 63)
    return dataclasses.replace(params, n=1, seed=seed)


def child_ids(request_id: str, n: int, taken: set[str]) -> list[str]:
    """n engine ids for the samples of prompt `request_id`, none of them in `taken` (every other id of the same
    batch), which they join: `request_id` + CHILD_SEP + j, with one more CHILD_SEP until none collides (a caller's
    id may itself end in CHILD_SEP + a digit). The ids only need to be unique: nothing reads them back."""
    sep = CHILD_SEP
    while True:
        ids = [f"{request_id}{sep}{j}" for j in range(n)]
        if taken.isdisjoint(ids):
            taken.update(ids)
            return ids
        sep += CHILD_SEP


def join_samples(parent_id: str, samples: list[RequestOutput]) -> RequestOutput:
    """The output of a request with n > 1: sample 0's fields at the top, every sample in `samples` (each under the
    parent's id), preemptions summed, the first token's time the earliest and the latency the latest."""
    for s in samples:
        s.request_id = parent_id
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    latencies = [s.latency_s for s in samples if s.latency_s is not None]
    return dataclasses.replace(samples[0], num_preemptions=sum(s.num_preemptions for s in samples),
                               ttft_s=min(ttfts, default=None), latency_s=max(latencies, default=None),
                               samples=samples, note=next((s.note for s in samples if s.note), None))


class ParentRequest:
    """The n child requests of one prompt with n > 1 samples and their outputs until all n are in.

    Made by engine.processing.request_builder.RequestBuilder.make_requests; the offline batch and the engine loop
    queue its `children`, and hand each child's output (finished or aborted) to `add`.

    Attributes:
        request_id: the prompt's id; the joined output and each of its samples carry it.
        children: the child requests, sample j at index j (engine ids from child_ids, params from child_params).
    """

    def __init__(self, request_id: str, children: list[Request]) -> None:
        self.request_id = request_id
        self.children = children
        self._index = {child.request_id: j for j, child in enumerate(children)}
        self._outputs: list[RequestOutput | None] = [None] * len(children)

    def add(self, out: RequestOutput) -> RequestOutput | None:
        """Keep the output of child `out.request_id`; once all n are in, return the prompt's output under
        `request_id`: the samples joined (join_samples), or when any of them was aborted one "abort" output
        without tokens (preemptions summed). None while samples are missing. Raises KeyError for an output of
        another request."""
        self._outputs[self._index[out.request_id]] = out
        if any(o is None for o in self._outputs):
            return None
        done = [o for o in self._outputs if o is not None]
        if any(o.finish_reason == "abort" for o in done):
            return RequestOutput(self.request_id, out.prompt_token_ids, [], "", "abort",
                                 num_preemptions=sum(o.num_preemptions for o in done))
        return join_samples(self.request_id, done)


def engine_requests(item: Request | ParentRequest) -> list[Request]:
    """The requests to queue for one prompt of make_requests: the request itself, or a parent's children."""
    return item.children if isinstance(item, ParentRequest) else [item]
