"""Per-request sampling parameters (the field's standard names, as in vLLM's `SamplingParams`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token of one request, and when to stop.

    Attributes:
        max_tokens: most output tokens to generate (tokens, >= 1). A request also stops at the model's context
            length (`finish_reason="length"` either way).
        temperature: softmax temperature; 0 means greedy (argmax), the mode used for correctness tests.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p (0 < top_p <= 1).
            Source: Holtzman et al., "The Curious Case of Neural Text Degeneration" (ICLR 2020).
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        seed: makes this request's samples reproducible whatever else is in the batch and after preemption: the
            uniform that draws output token i is a hash of (seed, i) (engine.sampler.counter_uniforms). None draws
            from the engine's generator.
        stop: strings that end the completion; the matched string is not part of the returned text.
        stop_token_ids: token ids that end the completion (the model's EOS is always one unless ignore_eos).
        ignore_eos: keep generating past EOS until max_tokens (for benchmarks with fixed output lengths).

    Raises:
        ValueError: when a value is out of range; the message names the field and the allowed range.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty; remove the empty string from `stop`")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token at every step."""
        return self.temperature == 0.0 or self.top_k == 1
