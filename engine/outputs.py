"""What the engine returns for each request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "error", "abort"]


@dataclass
class RequestOutput:
    """The finished result of one request.

    Attributes:
        request_id: the caller's id for the request (string).
        prompt_token_ids: the prompt as token ids, after the chat template when one was applied.
        output_token_ids: the generated token ids; a matched stop token is included, a stop string's tokens are
            included too (the text is cut, the token count is what the model computed).
        text: the decoded completion, cut before a matched stop string.
        finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the context length) or
            "error" (the request could not run; `error` says why and how to fix it) or "abort" (generate was told
            to stop before the request finished; no output, run it again later).
        error: None when the request ran, else a message naming the problem.
        num_preemptions: how often the request lost its KV blocks and was recomputed.
        ttft_s: seconds from the start of `generate` to the first output token (time to first token).
        latency_s: seconds from the start of `generate` to the last output token.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    error: str | None = None
    num_preemptions: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Completion length in tokens."""
        return len(self.output_token_ids)
