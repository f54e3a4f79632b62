"""LLMEngine: the public entry point of the engine (API contract; implementation lands next)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

# A prompt is text (wrapped in the chat template unless use_chat_template=False), a list of chat messages
# ({"role": ..., "content": ...}), or a list of token ids (sent as they are).
Prompt = str | list[dict[str, Any]] | list[int]


class LLMEngine:
    """Offline batch generation over a paged KV cache with continuous batching.

    Build it with `LLMEngine.from_model(path_or_url, EngineConfig(...))`; then `generate(prompts, params)`.
    Attributes: `tokenizer` (engine.tokenizer.Tokenizer: encode, decode, apply_chat_template, eos_token_id),
    `model_name` (str), `max_model_len` (tokens), `device_name` (str, e.g. "cpu" or "NVIDIA H100 80GB HBM3").
    """

    @classmethod
    def from_model(cls, model: str | None = None, config: EngineConfig | None = None) -> LLMEngine:
        """Load a model (GGUF path or fsspec URL; None = the default SmolLM2-135M-Instruct Q4_1)."""
        raise NotImplementedError

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        use_chat_template: bool = True,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for all prompts as one continuous batch; outputs come back in the order of `prompts`.

        A prompt that cannot run (empty, or longer than max_model_len - 1 tokens) gets finish_reason="error" and
        an `error` message; the others go on. `on_output` is called once per request as soon as it finishes
        (for progress and checkpoints). Raises ValueError when the lengths of prompts, params and ids differ.
        """
        raise NotImplementedError
