"""The prompt sizes of a shard's rows as the job's engine will run them, for the generate forecast (jobs.plan.forecast):
each row's prompt tokens through the chat template, an image row's with its images' tokens counted by the model's own
processor from the images' sizes (engine.multimodal.processor.ImageProcessor.prompt_size: no pixels processed, no
model run), and the rows that are too long for --max-model-len with them (the run makes those error rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import LLMEngine
    from pipeline.config import RunConfig
    from pipeline.shard_rows import ShardRows


@dataclass(frozen=True)
class PromptSizes:
    """Per row of a shard, in row order: `tokens`, its prompt's tokens as the engine runs it (image tokens included;
    0 for a row that will be an error row before it is tokenized: null, empty, a request error, an image that does
    not open), `image_tokens` of those, and its `images`; `max_model_len`: the engine's (tokens; a prompt needs at
    least one fewer)."""

    tokens: list[int]
    image_tokens: list[int]
    images: list[int]
    max_model_len: int

    @property
    def runnable(self) -> list[int]:
        """Rows that will run: a prompt of 1 to max_model_len - 1 tokens."""
        return [k for k, n in enumerate(self.tokens) if 0 < n < self.max_model_len]

    @property
    def too_long(self) -> list[int]:
        """Rows whose prompt (text and image tokens) leaves no room in max_model_len: error rows in the run."""
        return [k for k, n in enumerate(self.tokens) if n >= self.max_model_len]

    def ran(self, values: list[int]) -> int:
        """The sum of `values` (per row) over the rows that run."""
        return sum(values[k] for k in self.runnable)

    def too_long_note(self) -> str:
        """One line on the rows too long for max_model_len (the longest one's text and image tokens, the ways out),
        or "" when there are none."""
        if not self.too_long:
            return ""
        k = max(self.too_long, key=lambda j: self.tokens[j])
        images = (f" = {self.tokens[k] - self.image_tokens[k]:,} text + {self.image_tokens[k]:,} image tokens "
                  f"of {self.images[k]} images" if self.images[k] else "")
        fixes = "raise --max-model-len" + (", or lower --max-pixels" if any(self.images) else ", or shorten them")
        n = len(self.too_long)
        return (f"{n:,} of the {len(self.tokens):,} rows read {'is' if n == 1 else 'are'} longer than --max-model-len "
                f"{self.max_model_len:,} allows (the longest: {self.tokens[k]:,} tokens{images}); they will be error "
                f"rows: {fixes}")


def _size(engine: LLMEngine, prompt: Any, cfg: RunConfig) -> tuple[int, int, int]:
    """(tokens, image tokens, images) of one row's prompt as the engine will run it; (0, 0, 0) for a prompt the
    engine refuses before running it (an error row)."""
    from engine.multimodal.inputs import is_image_prompt

    if is_image_prompt(prompt) and engine.image_processor is not None and engine.tokenizer is not None:
        try:
            n, counts = engine.image_processor.prompt_size(prompt, engine.tokenizer, cfg.use_chat_template,
                                                           cfg.allow_special_tokens)
        except ValueError:
            return 0, 0, 0
        return n, sum(counts), len(counts)
    if not (isinstance(prompt, str | list) and prompt):
        return 0, 0, 0
    try:
        return len(engine.prompt_token_ids(prompt, cfg.use_chat_template, cfg.allow_special_tokens)), 0, 0
    except ValueError:
        return 0, 0, 0


def prompt_sizes(engine: LLMEngine, rows: ShardRows, cfg: RunConfig) -> PromptSizes:
    """The PromptSizes of `rows` (their images read into image prompts: pipeline.images.image_rows) under the job's
    `cfg` on `engine` (the job's, loaded for the calibration)."""
    sizes = [(0, 0, 0) if (rows.errors and rows.errors[k]) else _size(engine, p, cfg)
             for k, p in enumerate(rows.prompts)]
    return PromptSizes([s[0] for s in sizes], [s[1] for s in sizes], [s[2] for s in sizes], engine.max_model_len)
