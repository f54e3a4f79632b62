"""One generation request, tracked by counters rather than phases."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    import numpy as np

    from engine.multimodal.inputs import MultiModalItem


class RequestStatus(enum.Enum):
    """Where a request is in the scheduler's queues."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A prompt, its generated tokens so far, and how many of them the KV cache holds.

    NOTE: prefill, chunked prefill, decode and recompute after preemption all follow from two counters:
    `num_computed_tokens` (tokens whose K/V are in the cache) against `num_tokens` (prompt + output). A step feeds
    tokens [num_computed_tokens, num_computed_tokens + n) and samples only when it reaches `num_tokens`. Only the
    scheduler (engine.core.scheduler.Scheduler) changes a request's counters, status and finish_reason.

    Attributes:
        request_id: caller's id (string).
        prompt_token_ids: the prompt (tokens).
        output_token_ids: generated tokens so far.
        sampling_params: how to sample and when to stop.
        num_computed_tokens: tokens whose K/V are in this request's blocks.
        num_preemptions: times the request lost its blocks and went back to waiting.
        kv_start_len: num_tokens when the request was last admitted (its KV cache started, 0 before): what picks
            LongRoPE's factor set of every key in its cache (engine.layers.rope.longrope_table_rows).
        finish_reason: None until the request finishes; then "stop" (EOS, a stop token or a stop string), "length"
            (max_tokens or max_model_len) or "abort" (stopped before it finished: Scheduler.abort_requests /
            abort_all; its output has no tokens, engine.outputs.RequestOutput).
        detokenizer: the output's text and stop strings (engine.text.detokenizer), or None when there is no tokenizer.
        mm_items: the prompt's images (engine.multimodal.inputs.MultiModalItem: pixel_values, placeholder offset and
            length, mm hash), ordered by offset; () for a text prompt.
        mrope_positions: an M-RoPE model's prompt positions, int64 [3, prompt tokens] (engine.multimodal.mrope), or
            None (plain RoPE: a text prompt, or a model without M-RoPE); mrope_delta: what a generated token's index
            adds to make its position (max prompt position + 1 - prompt length; 0 without).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 detokenizer: IncrementalDetokenizer | None = None, mm_items: tuple[MultiModalItem, ...] = (),
                 mrope_positions: np.ndarray | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens; give a non-empty prompt")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.kv_start_len = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        self.mm_items = tuple(sorted(mm_items, key=lambda item: item.offset))
        if self.mm_items and (self.mm_items[0].offset < 0 or self.mm_items[-1].end > len(self.prompt_token_ids)):
            raise ValueError(f"request {request_id!r}: an image's placeholders fall outside its prompt")
        self.mrope_positions = mrope_positions
        self.mrope_delta = 0
        if mrope_positions is not None:
            if mrope_positions.shape != (3, len(self.prompt_token_ids)):
                raise ValueError(f"request {request_id!r}: M-RoPE positions {mrope_positions.shape} are not 3 per "
                                 f"prompt token ({len(self.prompt_token_ids)})")
            self.mrope_delta = int(mrope_positions.max()) + 1 - len(self.prompt_token_ids)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # For the scheduler's per-step stop test: the total length at max_tokens, and whether the request has stop
        # ids or stop strings (then every new token is checked in full, engine.core.stop.check_stop).
        self.max_num_tokens = len(self.prompt_token_ids) + sampling_params.max_tokens
        self.has_stop_checks = bool(sampling_params.stop or sampling_params.stop_token_ids)
        # Asynchronous steps (engine.llm_engine, EngineConfig.async_scheduling): the token still on the device, the
        # last of all_token_ids as a placeholder, brings the request to its length limit, so it runs no further step.
        self.ends_at_pending_token = False

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens generated so far."""
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token (its K/V is computed by the next step)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")
