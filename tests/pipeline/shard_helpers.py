"""Helpers of the shard tests (tests/pipeline): sizes of the shared GSM8K shard, run options, a counting
engine, a run stopped after some rows."""

from __future__ import annotations

from typing import Any

import pytest

from engine import LLMEngine
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.shard import ShardInterrupted, run_shard

ROWS = 16
NULL_ROW = 5
MAX_TOKENS = 16


class CountingEngine:
    """Wraps an engine and counts the prompts sent to generate or embed (the rows a run really ran)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.prompts = engine, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, prompts: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.prompts += len(prompts)
        return self.engine.generate(prompts, *args, **kwargs)

    def embed(self, texts: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.prompts += len(texts)
        return self.engine.embed(texts, *args, **kwargs)


def shard_cfg(**kw: Any) -> RunConfig:
    """The run options of these tests (greedy, MAX_TOKENS tokens per row). Parts are cut by row count only (an hour
    between time-based checkpoints), so a slow, shared machine does not change which parts a test sees."""
    return RunConfig(**{"prompt_column": "question", "max_tokens": MAX_TOKENS, "checkpoint_seconds": 3600.0, **kw})


def interrupt_after(engine: LLMEngine, shard: Shard, out: str, cfg: RunConfig, rows: int) -> ShardInterrupted:
    """Run the shard with a should_stop that fires once `rows` rows have finished; return the ShardInterrupted it
    raised, after checking that it committed exactly the rows that finished (at least `rows`)."""
    finished = [0]

    def progress(n: int, tokens: int) -> None:
        finished[0] += n

    with pytest.raises(ShardInterrupted) as stopped:
        run_shard(engine, shard, "question", out, cfg, progress=progress, should_stop=lambda: finished[0] >= rows)
    assert stopped.value.rows_committed == finished[0] >= rows
    return stopped.value
