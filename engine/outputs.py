"""What the engine returns for each request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    import numpy as np

FinishReason = Literal["stop", "length", "error", "abort"]


class TopLogprob(NamedTuple):
    """One of the most likely tokens at a position: its id, its text (the token decoded alone, special tokens
    spelt out) and its log probability (natural log, from the model's raw logits)."""

    token_id: int
    token: str
    logprob: float


class TokenLogprob(NamedTuple):
    """One output token's log probability (natural log, from the model's raw logits: before temperature, penalties,
    logit_bias and grammar masks, as vLLM v1's raw_logprobs) and the `logprobs` most likely tokens there, most likely
    first (OpenAI's top_logprobs)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob]


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
        logprobs: one TokenLogprob per output token when SamplingParams.logprobs was set, else None.
        valid: for a structured output (SamplingParams.structured_outputs): True when the output completed the
            grammar (it parses and matches the constraint), False when it stopped before (max_tokens: finish_reason
            "length"); None for unconstrained requests.
        samples: for n > 1, the n samples in order (each a RequestOutput with its own text, tokens, finish_reason,
            logprobs and valid; the top-level fields are sample 0's); None when n == 1.
        note: why a row that ran is what it is where its fields alone do not say: a "length" output whose
            max_tokens was cut to fit max_model_len (its prompt + max_tokens did not fit) names both numbers; None
            otherwise (with n > 1, the first sample's note that is set).
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
    logprobs: list[TokenLogprob] | None = None
    valid: bool | None = None
    samples: list[RequestOutput] | None = None
    note: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Completion length in tokens."""
        return len(self.output_token_ids)


@dataclass
class EmbeddingOutput:
    """The embedding of one text (LLMEngine.embed).

    Attributes:
        request_id: the caller's id for the text (string; its index when none was given).
        embedding: float32 numpy array [dim] (dim = hidden size times the pooling modes, or the `dimensions` asked),
            L2-normalized when the model's sentence-transformers files say so, or `normalize` or `dimensions` was
            asked (engine.pooling.embed_options); None for an error output.
        num_prompt_tokens: tokens the model read, special tokens and any prefix included (after truncation).
        truncated: the text was longer than the model's max_seq_length and its tail was dropped.
        error: why the text could not be embedded (not a string, empty / only whitespace, or over max_seq_length
            with truncation off), or None.
    """

    request_id: str
    embedding: np.ndarray | None
    num_prompt_tokens: int
    truncated: bool = False
    error: str | None = None


@dataclass
class ClassificationOutput:
    """The class of one text (LLMEngine.classify, engine.pooling.classifier).

    Attributes:
        request_id: the caller's id for the text (string; its index when none was given).
        label: the most probable label's name (config.json id2label); None for a regression head (problem_type
            "regression" or a single label: its scores are raw, no label wins) and for an error output.
        score: the label's probability (softmax over the labels; a multi-label head's sigmoid of its logit); for
            a regression head its first raw logit; None for an error output.
        scores: float32 numpy array [num_labels], by label id: the softmax probabilities (sum 1), a multi-label
            head's per-label sigmoid probabilities (each in (0, 1), independent), or for a regression head the raw
            logits; None for an error output.
        num_prompt_tokens: tokens the model read, special tokens included (after truncation).
        truncated: the text was longer than the model's row limit and its tail was dropped.
        error: why the text could not be classified (not a string, empty / only whitespace), or None.
        labels: a multi-label head's (problem_type "multi_label_classification") labels whose probability is
            >= MULTI_LABEL_THRESHOLD (0.5: logit >= 0), in id order, possibly empty; None for any other head and
            for an error output.
    """

    request_id: str
    label: str | None
    score: float | None
    scores: np.ndarray | None
    num_prompt_tokens: int
    truncated: bool = False
    error: str | None = None
    labels: list[str] | None = None


#: A multi-label head's label is on when its sigmoid probability is at least this (HF's and vLLM's usual cut).
MULTI_LABEL_THRESHOLD = 0.5


@dataclass
class ScoreOutput:
    """The score of one (text, text_pair) pair (LLMEngine.score, engine.pooling.scorer).

    Attributes:
        request_id: the caller's id for the pair (string; its index when none was given).
        score: a cross-encoder's relevance (its one logit through sentence-transformers CrossEncoder's activation:
            sigmoid, in (0, 1), unless the model's files name Identity: the raw logit), or an embedding model's
            cosine similarity of the two texts' embeddings (in [-1, 1]); None for an error output.
        num_prompt_tokens: tokens the model read, special tokens included, after truncation: the pair's one
            sequence for a cross-encoder, both texts' for an embedding model.
        truncated: the pair (a cross-encoder: longest first, as HF tokenizers cut pairs) or either text (an
            embedding model) ran past the model's row limit and tokens were dropped.
        error: why the pair could not be scored (either text not a string, empty or only whitespace), or None.
    """

    request_id: str
    score: float | None
    num_prompt_tokens: int
    truncated: bool = False
    error: str | None = None
