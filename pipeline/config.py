"""What a job asks of each row: which columns hold what, and how to sample."""

from __future__ import annotations

from dataclasses import dataclass

from engine import SamplingParams

DEFAULT_PRICE_PER_HOUR_USD = 2.0  # a spot H100 at a large cloud, late 2026; pass the real price with --price-per-hour


class InputError(ValueError):
    """The input cannot be read as asked (missing column, no files, bad options). The message names the fix."""


@dataclass(frozen=True)
class RunConfig:
    """How rows become requests and how the work is cut and billed.

    Attributes:
        prompt_column: column of prompt text (wrapped in the chat template unless use_chat_template is False).
        messages_column: column of chat messages (list of {role, content}); used when the prompt column is absent.
        id_column: column of row ids; when the input lacks it, ids are row positions in the file.
        use_chat_template: wrap text prompts in the model's chat template.
        max_tokens, temperature, top_p, top_k, seed, stop: sampling, as engine.SamplingParams. With a seed, each row
            samples with the seed mixed with a hash of its id, so rows differ but reruns repeat them exactly.
        rows_per_shard: rows per shard (the unit of scheduling, retry and accounting).
        price_per_hour_usd: price of one device hour, USD.
        limit: only the first `limit` rows of the input (None = all).
        checkpoint_rows: a running shard commits a checkpoint part every `checkpoint_rows` finished rows, or
            every `checkpoint_seconds` seconds, whichever comes first (checked as rows finish). A preempted shard
            loses at most one interval of work; smaller intervals cost more (small) object-store writes.
        heartbeat_seconds: while rows are generated, an attempt that committed no part for this long leaves a
            sign of life (a tiny create-only record, pipeline.attempts.Heartbeat): an attempt killed without an end
            record is billed from its start to its last sign of life (seconds; default 15).

    Raises:
        InputError: when a value is out of range.
    """

    prompt_column: str = "prompt"
    messages_column: str = "messages"
    id_column: str = "id"
    use_chat_template: bool = True
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    rows_per_shard: int = 1000
    price_per_hour_usd: float = DEFAULT_PRICE_PER_HOUR_USD
    limit: int | None = None
    checkpoint_rows: int = 64
    checkpoint_seconds: float = 60.0
    heartbeat_seconds: float = 15.0

    def __post_init__(self) -> None:
        for name in ("prompt_column", "messages_column", "id_column"):
            if not getattr(self, name):
                raise InputError(f"{name} must name a column, got an empty string")
        if self.rows_per_shard < 1:
            raise InputError(f"rows_per_shard must be >= 1, got {self.rows_per_shard}")
        if self.price_per_hour_usd < 0:
            raise InputError(f"price per hour must be >= 0 USD, got {self.price_per_hour_usd}")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"limit must be >= 1 row, got {self.limit}")
        if self.checkpoint_rows < 1:
            raise InputError(f"checkpoint_rows must be >= 1 row, got {self.checkpoint_rows}")
        if not self.checkpoint_seconds > 0:
            raise InputError(f"checkpoint_seconds must be > 0 seconds, got {self.checkpoint_seconds}")
        if not self.heartbeat_seconds > 0:
            raise InputError(f"heartbeat_seconds must be > 0 seconds, got {self.heartbeat_seconds}")
        try:
            self.sampling_params()
        except ValueError as e:
            raise InputError(str(e)) from e

    def sampling_params(self, row_seed: int | None = None) -> SamplingParams:
        """engine.SamplingParams for one row (`row_seed` overrides the seed)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed if row_seed is None else row_seed, stop=self.stop)
