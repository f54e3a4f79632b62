"""What a job asks of each row: which columns hold what, and how to sample."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from engine import SamplingParams, StructuredOutputsParams
from schemas.job_spec import Columns, Embedding, JobSpec, Sampling, Sharding, format_problems
from schemas.sampling import STRUCTURED_FIELDS

# The defaults are the job spec's (schemas.job_spec, the one definition of a job's options).
_COLUMNS, _SAMPLING, _SHARDING, _EMBEDDING = Columns(), Sampling(), Sharding(), Embedding()
DEFAULT_PRICE_PER_HOUR_USD: float = JobSpec.model_fields["price_per_hour"].default


class InputError(ValueError):
    """The input cannot be read as asked (missing column, no files, bad options). The message names the fix."""


@dataclass(frozen=True)
class RunConfig:
    """How rows become requests and how the work is cut and billed.

    Attributes:
        prompt_column: column of prompt text (wrapped in the chat template unless use_chat_template is False).
        messages_column: column of chat messages (list of {role, content}); used when the prompt column is absent.
        id_column: column of row ids; when the input lacks it, ids are row positions in the file.
        text_pair_column: column of each row's second text (task score only, and required there: the prompt column
            holds the first); None for the other tasks.
        image_column: column of each row's images (pipeline.images: bytes, {bytes, path} structs, paths or fsspec
            URLs, or lists of them); None: rows carry images only as their messages' image parts.
        max_images_per_row: most images in one row (image column plus image parts); more make an error row. None:
            no limit but the context.
        max_pixels, min_pixels: the pixel limits of one image (width x height) set through the model's image
            processor (the engine's EngineConfig.max_image_pixels / min_image_pixels; jobs.plan.image_check refuses
            values the processor cannot honour); None: the processor's own. Kept here as options that shape results.
        use_chat_template: wrap text prompts in the model's chat template.
        allow_special_tokens: parse control-token text in prompts and message contents as control tokens (raw
            control); by default user text is encoded as text (engine.text.tokenizer).
        max_tokens, temperature, top_p, top_k, seed, stop, n, logprobs, presence_penalty, frequency_penalty,
            repetition_penalty, min_tokens: sampling, as engine.SamplingParams. With a seed, each row samples with the
            seed mixed with a hash of its id, so rows differ but reruns repeat them exactly.
        json_schema (JSON Schema text, not a path: jobs.spec reads the file), json_object, regex, choices: the
            job's structured output (engine.StructuredOutputsParams), at most one of them.
        rows_per_shard: rows per shard (the unit of scheduling, retry and accounting).
        price_per_hour_usd: price of one device hour, USD.
        limit: only the first `limit` rows of the input (None = all).
        checkpoint_rows: a running shard commits a checkpoint part every `checkpoint_rows` finished rows, or
            every `checkpoint_seconds` seconds, whichever comes first (checked as rows finish). A preempted shard
            loses at most one interval of work; smaller intervals cost more (small) object-store writes.
        heartbeat_seconds: while rows are generated, an attempt that committed no part for this long leaves a
            sign of life (a tiny create-only record, pipeline.attempts.Heartbeat): an attempt killed without an end
            record is billed from its start to its last sign of life (seconds; default 15).
        task: "generate" (a completion per row), "embed" (an embedding per row: pipeline.shard_embed), "classify"
            (a label per row: the same rows) or "score" (a relevance per (prompt, text pair) row: the same rows).
        embedding_dim: elements of one embedding (task embed only: the model's hidden size times its pooling
            modes, jobs.plan.task_check.embedding_dim; `dimensions` when set), the width of the results'
            fixed-size `embedding` column.
        dimensions, normalize, prefix, truncate: an embed job's options (schemas.spec_sections.Embedding, passed to
            engine.LLMEngine.embed); at their defaults for task generate.
        embedding_dtype: the element type of an embed job's `embedding` column, float32 or float16 (the engine's
            float32 vectors are cast as checkpoint parts are written: pipeline.shard_embed.embed_part_table).

    Raises:
        InputError: when a value is out of range.
    """

    prompt_column: str = _COLUMNS.prompt
    messages_column: str = _COLUMNS.messages
    id_column: str = _COLUMNS.id
    text_pair_column: str | None = _COLUMNS.text_pair
    image_column: str | None = _COLUMNS.image
    max_images_per_row: int | None = _COLUMNS.max_images_per_row
    max_pixels: int | None = _COLUMNS.max_pixels
    min_pixels: int | None = _COLUMNS.min_pixels
    use_chat_template: bool = _COLUMNS.chat_template
    allow_special_tokens: bool = _COLUMNS.allow_special_tokens
    max_tokens: int = _SAMPLING.max_tokens
    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    top_k: int = _SAMPLING.top_k
    seed: int | None = _SAMPLING.seed
    stop: tuple[str, ...] = _SAMPLING.stop
    n: int = _SAMPLING.n
    logprobs: int | None = _SAMPLING.logprobs
    presence_penalty: float = _SAMPLING.presence_penalty
    frequency_penalty: float = _SAMPLING.frequency_penalty
    repetition_penalty: float = _SAMPLING.repetition_penalty
    min_tokens: int = _SAMPLING.min_tokens
    json_schema: str | None = _SAMPLING.json_schema
    json_object: bool = _SAMPLING.json_object
    regex: str | None = _SAMPLING.regex
    choices: tuple[str, ...] | None = _SAMPLING.choices
    rows_per_shard: int = _SHARDING.rows_per_shard
    price_per_hour_usd: float = DEFAULT_PRICE_PER_HOUR_USD
    limit: int | None = _SHARDING.limit
    checkpoint_rows: int = _SHARDING.checkpoint_rows
    checkpoint_seconds: float = _SHARDING.checkpoint_seconds
    heartbeat_seconds: float = 15.0
    task: str = "generate"
    embedding_dim: int | None = None
    dimensions: int | None = _EMBEDDING.dimensions
    normalize: bool = _EMBEDDING.normalize
    prefix: str = _EMBEDDING.prefix
    truncate: bool = _EMBEDDING.truncate
    embedding_dtype: str = _EMBEDDING.embedding_dtype

    def __post_init__(self) -> None:
        # The job spec's rules, so a RunConfig built in code is checked as a spec is (same messages).
        try:
            JobSpec.model_validate({
                "input": "-", "output": "-", "price_per_hour": self.price_per_hour_usd, "task": self.task,
                "columns": {"prompt": self.prompt_column, "messages": self.messages_column, "id": self.id_column,
                            "text_pair": self.text_pair_column, "image": self.image_column,
                            "max_images_per_row": self.max_images_per_row, "max_pixels": self.max_pixels,
                            "min_pixels": self.min_pixels, "chat_template": self.use_chat_template,
                            "allow_special_tokens": self.allow_special_tokens},
                "sampling": {name: getattr(self, name) for name in Sampling.model_fields},
                "sharding": {"rows_per_shard": self.rows_per_shard, "limit": self.limit,
                             "checkpoint_rows": self.checkpoint_rows, "checkpoint_seconds": self.checkpoint_seconds},
                "embedding": self.embedding_section()})
        except ValidationError as e:
            raise InputError("; ".join(format_problems(e))) from None
        if (self.task == "embed") != (self.embedding_dim is not None) or (self.embedding_dim or 1) < 1:
            raise InputError(f"embedding_dim (elements of one embedding, >= 1) is set for task embed only; got task "
                             f"{self.task!r} with embedding_dim {self.embedding_dim!r}")
        if self.task != "embed" and self.embedding_section() != _EMBEDDING.model_dump():
            raise InputError(f"the embed options {self.embedding_section()} apply to task embed only, not "
                             f"{self.task!r}")
        if (self.task == "score") != (self.text_pair_column is not None):
            raise InputError(f"--text-pair-column applies to --task score only; this job's task is {self.task}: drop "
                             "it or add --task score" if self.text_pair_column is not None else
                             "--task score needs --text-pair-column COLUMN, the column of each row's second text "
                             "(the prompt column, --prompt-column, holds the first)")
        if self.image_column is not None and self.task != "generate":
            raise InputError(f"--image-column applies to --task generate only (images in, text out); this job's task "
                             f"is {self.task}: drop --image-column or the --task")
        if self.dimensions is not None and self.dimensions != self.embedding_dim:
            raise InputError(f"embedding_dim {self.embedding_dim} must be the dimensions asked, {self.dimensions}")
        if not self.heartbeat_seconds > 0:
            raise InputError(f"heartbeat_seconds must be > 0 seconds, got {self.heartbeat_seconds}")
        try:
            self.sampling_params()
        except ValueError as e:
            raise InputError(str(e)) from e

    def sampling_params(self, row_seed: int | None = None) -> SamplingParams:
        """engine.SamplingParams for one row (`row_seed` overrides the seed). Raises ValueError for a structured
        output that is not one constraint (two of them, a json_schema that is not JSON)."""
        values = {name: getattr(self, name) for name in Sampling.model_fields if name not in STRUCTURED_FIELDS}
        values["seed"] = self.seed if row_seed is None else row_seed
        structured = StructuredOutputsParams.from_fields(**{f: getattr(self, f) for f in STRUCTURED_FIELDS})
        return SamplingParams(**values, structured_outputs=structured)

    def embedding_section(self) -> dict[str, object]:
        """The job spec's embedding section (schemas.spec_sections.Embedding) of this config, by field name."""
        return {name: getattr(self, name) for name in Embedding.model_fields}

    def embed_options(self) -> dict[str, object]:
        """The embed options (dimensions, normalize, prefix, truncate) as engine.LLMEngine.embed's keywords; the
        embedding_dtype is the pipeline's (the engine returns float32)."""
        return {k: v for k, v in self.embedding_section().items() if k != "embedding_dtype"}
