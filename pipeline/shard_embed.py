"""An embed, classify or score job's rows (`--task embed|classify|score`): the text of each row embedded or
classified, or its (text, text pair) scored, by the engine (engine.LLMEngine.embed / classify / score), bad rows as
error rows, finished rows handed to the shard's checkpoints as they come; the rows as checkpoint parts.

The shard's machinery (pipeline.shard: attempts, checkpoints, exactly-once results, accounting) is the generate
path's; pipeline.row_kinds picks these functions for an embed, classify or score job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from engine.loop.clock import DeviceClock
from pipeline.config import RunConfig
from pipeline.shard_requests import ProgressFn, RowRequests
from pipeline.shard_rows import ShardRows
from schemas.arrow import CLASSIFY_PART_SCHEMA, SCORE_PART_SCHEMA, embed_part_schema

if TYPE_CHECKING:  # torch: imported where a shard runs (a worker), never by the client
    from engine import LLMEngine
    from engine.loop.engine_loop import EngineLoop
    from engine.outputs import ClassificationOutput, EmbeddingOutput, ScoreOutput
    from pipeline.shard_engine import ShardRunner

#: Called with (row index, its output) as each row finishes.
EmbedRowFn = Callable[[int, "EmbeddingOutput | ClassificationOutput | ScoreOutput"], None]


def embed_requests(rows: ShardRows, cfg: RunConfig) -> RowRequests:
    """The rows of an embed job that cannot run (null, not a string, empty or only whitespace, a request error from
    the input: engine.text.prompts.text_problem; for a score job its text pair too, the error naming the column)
    and those that can; no sampling parameters. No engine."""
    from engine.text.prompts import text_problem

    errors: dict[int, str] = {}
    for k, text in enumerate(rows.prompts):
        problem = (rows.errors[k] if rows.errors else None) or text_problem(text)
        if not problem and rows.pairs is not None and (pair := text_problem(rows.pairs[k])):
            problem = f"text pair column {cfg.text_pair_column!r}: {pair}"
        if problem:
            errors[k] = problem
    return RowRequests(errors, [k for k in range(len(rows.prompts)) if k not in errors], [])


def embed_rows(engine: LLMEngine | EngineLoop | ShardRunner | None, rows: ShardRows, cfg: RunConfig,
               progress: ProgressFn | None = None, *, on_row: EmbedRowFn | None = None,
               should_stop: Callable[[], bool] | None = None, clock: DeviceClock | None = None,
               requests: RowRequests | None = None
               ) -> list[EmbeddingOutput | ClassificationOutput | ScoreOutput | None]:
    """One EmbeddingOutput per row (cfg.task "classify": one ClassificationOutput; "score": one ScoreOutput of the
    row's text and its text pair, rows.pairs), in row order; None for a row left unfinished because `should_stop`
    said stop.

    Error rows (embed_requests) come first, as error outputs; the others are embedded (with cfg's embed options:
    dimensions, normalize, prefix, truncate, whose over-long rows become error outputs) in chunks of
    `cfg.checkpoint_rows` rows (each chunk sorted and batched by the engine), `should_stop` polled before each, so a
    stop loses at most one chunk's work. `on_row(k, output)` is called for every finished row k as its chunk ends,
    in this thread (the checkpoint hook); `progress(rows, 0)` then (no output tokens). `engine`: an engine, or a
    worker's engine loop whose engine this thread calls directly (an encoder has no steps: the loop's step thread
    idles); None only when no row can run. `clock` is accepted for generate_rows' signature: the caller's
    DeviceClock bills the engine's time, on an engine loop its wall time split equally among the shards that hold
    it at once (engine.loop.clock.IdleShare), so shards sharing a worker are not billed its time twice.
    Raises ValueError when `engine` is None and a row can run, or is a model that does not embed / classify (its
    message names the task); what `on_row` raises (a checkpoint commit that failed) propagates."""
    from engine.outputs import ClassificationOutput, EmbeddingOutput, ScoreOutput
    from pipeline.shard_engine import ShardRunner

    requests = requests or embed_requests(rows, cfg)
    runnable = requests.runnable
    if engine is None and runnable:
        raise ValueError(f"{len(runnable)} rows can run but no engine was given")
    runner = ShardRunner.of(engine)
    llm = None if runner is None else runner.engine
    task = cfg.task
    outputs: list[EmbeddingOutput | ClassificationOutput | ScoreOutput | None] = [None] * len(rows.prompts)
    for k, problem in requests.errors.items():
        outputs[k] = (ClassificationOutput(str(rows.ids[k]), None, None, None, 0, error=problem) if task == "classify"
                      else ScoreOutput(str(rows.ids[k]), None, 0, error=problem) if task == "score"
                      else EmbeddingOutput(str(rows.ids[k]), None, 0, error=problem))
        if on_row:
            on_row(k, outputs[k])
    if progress and requests.errors:
        progress(len(requests.errors), 0)
    step = max(1, cfg.checkpoint_rows)
    for start in range(0, len(runnable), step):
        if should_stop is not None and should_stop():
            break
        chunk = runnable[start:start + step]
        texts, ids = [rows.prompts[k] for k in chunk], [str(rows.ids[k]) for k in chunk]
        done = (llm.classify(texts, ids) if task == "classify"  # type: ignore[union-attr]
                else llm.score(texts, [rows.pairs[k] for k in chunk], ids) if task == "score"  # type: ignore[union-attr,index]
                else llm.embed(texts, request_ids=ids, **cfg.embed_options()))  # type: ignore[union-attr]
        for k, out in zip(chunk, done, strict=True):
            out.request_id = rows.ids[k]
            outputs[k] = out
            if on_row:
                on_row(k, out)
        if progress:
            progress(len(chunk), 0)
    return outputs


def embed_part_table(dim: int, dtype: str = "float32") -> Callable[[list[tuple[int, Any]], str, str | None],
                                                                    pa.Table]:
    """The part builder of an embed job whose embeddings have `dim` elements of `dtype` (float32 or float16: the
    job's --embedding-dtype; pipeline.checkpoint.PartTableFn): finished rows (position in the shard,
    EmbeddingOutput, a float32 vector) -> a table of schemas.arrow.embed_part_schema(dim, dtype), each vector cast
    to `dtype` here (float16: rounded to nearest). The builder raises ValueError for an embedding of another width
    (the engine's model is not the job's)."""
    schema = embed_part_schema(dim, dtype)

    def table(rows: list[tuple[int, EmbeddingOutput]], model: str, model_fingerprint: str | None = None) -> pa.Table:
        for _, o in rows:
            if o.embedding is not None and o.embedding.shape != (dim,):
                raise ValueError(f"row {o.request_id!r}: an embedding of {o.embedding.shape} elements, but the job "
                                 f"writes {dim}; the engine's model is not the one the job was started with")
        return pa.Table.from_pylist([{
            "id": o.request_id, "embedding": None if o.embedding is None else np.asarray(o.embedding, dtype),
            "prompt_tokens": o.num_prompt_tokens,
            "truncated": o.truncated, "error": o.error, "model": model, "model_fingerprint": model_fingerprint,
            "row": k} for k, o in rows], schema=schema)

    return table


def classify_part_table(rows: list[tuple[int, ClassificationOutput]], model: str,
                        model_fingerprint: str | None = None) -> pa.Table:
    """The part builder of a classify job (pipeline.checkpoint.PartTableFn): finished rows (position in the shard,
    ClassificationOutput) -> a table of schemas.arrow.CLASSIFY_PART_SCHEMA."""
    return pa.Table.from_pylist([{
        "id": o.request_id, "label": o.label, "score": o.score, "scores": o.scores, "labels": o.labels,
        "prompt_tokens": o.num_prompt_tokens, "error": o.error, "model": model, "model_fingerprint": model_fingerprint,
        "truncated": o.truncated, "row": k} for k, o in rows], schema=CLASSIFY_PART_SCHEMA)


def score_part_table(rows: list[tuple[int, ScoreOutput]], model: str, model_fingerprint: str | None = None) -> pa.Table:
    """The part builder of a score job (pipeline.checkpoint.PartTableFn): finished rows (position in the shard,
    ScoreOutput) -> a table of schemas.arrow.SCORE_PART_SCHEMA."""
    return pa.Table.from_pylist([{
        "id": o.request_id, "score": o.score, "prompt_tokens": o.num_prompt_tokens, "error": o.error, "model": model,
        "model_fingerprint": model_fingerprint, "truncated": o.truncated, "row": k} for k, o in rows],
        schema=SCORE_PART_SCHEMA)
