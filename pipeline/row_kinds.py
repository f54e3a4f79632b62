"""What a shard's rows are, by the job's task: how they become requests and run, what a finished row counts, and
how they are stored (checkpoint parts and results). pipeline.shard runs either kind through the same attempts,
checkpoints, exactly-once commits and accounting.

- generate: a completion per row (pipeline.shard_requests; schemas.CHECKPOINT_PART_SCHEMA / RESULTS_SCHEMA);
- embed: an embedding per row (pipeline.shard_embed; schemas.arrow.embed_part_schema / embed_results_schema);
- classify: a label and scores per row (pipeline.shard_embed's rows too; schemas.arrow.CLASSIFY_*_SCHEMA);
- score: a relevance per (text, text pair) row (pipeline.shard_embed's rows too; schemas.arrow.SCORE_*_SCHEMA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.checkpoint import PartTableFn, completion_tokens, part_table
from pipeline.config import RunConfig
from pipeline.shard_embed import classify_part_table, embed_part_table, embed_requests, embed_rows, score_part_table
from pipeline.shard_requests import RowRequests, generate_rows, row_requests
from pipeline.shard_rows import ShardRows
from schemas.arrow import (
    CHECKPOINT_PART_SCHEMA,
    CLASSIFY_PART_SCHEMA,
    CLASSIFY_RESULTS_SCHEMA,
    RESULTS_SCHEMA,
    SCORE_PART_SCHEMA,
    SCORE_RESULTS_SCHEMA,
    embed_part_schema,
    embed_results_schema,
)


@dataclass(frozen=True)
class RowKind:
    """One task's rows in a shard.

    Attributes:
        requests: the rows' RowRequests before any engine (error rows and runnable rows).
        run: runs the rows (generate_rows' signature); one output per row, in row order.
        part_table: a checkpoint part of finished rows (pipeline.checkpoint.PartTableFn).
        part_schema / results_schema: the Arrow schemas of its parts and of its results.
        output_tokens: tokens a finished row generated (0 for an embedding).
        aborted: whether an output is a row left unfinished by a stop (generate: finish_reason "abort"; embed,
            classify, score: None).
    """

    requests: Callable[[ShardRows, RunConfig], RowRequests]
    run: Callable[..., list[Any]]
    part_table: PartTableFn
    part_schema: pa.Schema
    results_schema: pa.Schema
    output_tokens: Callable[[Any], int]
    aborted: Callable[[Any], bool]


GENERATE = RowKind(row_requests, generate_rows, part_table, CHECKPOINT_PART_SCHEMA, RESULTS_SCHEMA,
                   completion_tokens, lambda out: out.finish_reason == "abort")
CLASSIFY = RowKind(embed_requests, embed_rows, classify_part_table, CLASSIFY_PART_SCHEMA, CLASSIFY_RESULTS_SCHEMA,
                   lambda out: 0, lambda out: out is None)
SCORE = RowKind(embed_requests, embed_rows, score_part_table, SCORE_PART_SCHEMA, SCORE_RESULTS_SCHEMA,
                lambda out: 0, lambda out: out is None)


#: (task, the column of its results that marks it), in the order to test them: classify's `label` before score's
#: `score` (a classify job's results hold a score too).
_RESULTS_MARKS = (("classify", "label"), ("score", "score"), ("embed", "embedding"), ("generate", "completion"))


def results_task(names: Sequence[str]) -> str | None:
    """The task whose results (or checkpoint parts) have the columns `names` (a results file's schema names):
    generate, embed, classify or score; None for none of them."""
    return next((task for task, column in _RESULTS_MARKS if column in names), None)


def row_kind(cfg: RunConfig) -> RowKind:
    """The RowKind of the job's task (cfg.task; an embed job's schemas are cfg.embedding_dim wide, of
    cfg.embedding_dtype)."""
    if cfg.task in ("classify", "score"):
        return CLASSIFY if cfg.task == "classify" else SCORE
    if cfg.task != "embed":
        return GENERATE
    dim, dtype = cfg.embedding_dim or 0, cfg.embedding_dtype  # RunConfig holds the width set for task embed
    return RowKind(embed_requests, embed_rows, embed_part_table(dim, dtype), embed_part_schema(dim, dtype),
                   embed_results_schema(dim, dtype), lambda out: 0, lambda out: out is None)
