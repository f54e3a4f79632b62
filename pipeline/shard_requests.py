"""Row -> request mapping: a shard's rows as requests on the worker's resident engine loop (engine.loop.engine_loop),
each with the job's sampling and its own values put in, bad rows as error outputs, and the per-row checkpoint
callback run in the shard's own thread as rows finish."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine import RequestOutput, SamplingParams
from engine.loop.clock import DeviceClock
from pipeline.checkpoint import completion_tokens
from pipeline.config import RunConfig
from pipeline.row_options import row_sampling_params
from pipeline.shard_rows import ShardRows

if TYPE_CHECKING:  # torch: generate_rows imports it when it runs (on a worker), not the client that submits shards
    from engine import LLMEngine
    from engine.loop.engine_loop import EngineLoop
    from pipeline.shard_engine import ShardRunner

# Called with (rows finished, output tokens of those rows) as rows finish.
ProgressFn = Callable[[int, int], None]
# Called with (row index, its output) as each row finishes.
RowFn = Callable[[int, RequestOutput], None]


def _row_seed(seed: int | None, row_key: str) -> int | None:
    return None if seed is None else (seed * 1_000_003 + zlib.crc32(row_key.encode())) % (1 << 31)


@dataclass(frozen=True)
class RowRequests:
    """A shard's rows as requests, found before any engine: the error of each row that cannot run (null, empty, a
    request error from the input, out-of-range per-row sampling values; indices into the rows), and the rows that
    can, each with its SamplingParams (the job's, its own values put in). A row that is too long for the model is
    found by the engine when it tokenizes it, so it is among `runnable` here."""

    errors: dict[int, str]
    runnable: list[int]
    params: list[SamplingParams]


def row_requests(rows: ShardRows, cfg: RunConfig) -> RowRequests:
    """The requests of `rows` under the job's `cfg` (RowRequests): no engine, no tokenizer."""
    from engine.text.prompts import prompt_problem

    errors: dict[int, str] = {}
    runnable: list[int] = []
    params: list[SamplingParams] = []
    for k, prompt in enumerate(rows.prompts):
        # An image prompt (a dict: pipeline.images) is checked by the engine's processor when it runs.
        problem = (rows.errors[k] if rows.errors else None) or (
            None if isinstance(prompt, dict) else prompt_problem(prompt, token_ids=False))
        if not problem:
            try:
                key = rows.ids[k] if rows.ids[k] is not None else f"#{rows.positions[k] if rows.positions else k}"
                params.append(row_sampling_params(cfg.sampling_params(_row_seed(cfg.seed, key)),
                                                  rows.overrides[k] if rows.overrides else None))
            except ValueError as e:
                problem = f"this row's own sampling values: {e}"
        if problem:
            errors[k] = problem
        else:
            runnable.append(k)
    return RowRequests(errors, runnable, params)


def _text_only(requests: RowRequests, rows: ShardRows, runner: ShardRunner | None) -> RowRequests:
    """`requests` with the image prompts (dicts: pipeline.images) among the runnable rows as error rows when
    `runner`'s model is text-only (it would refuse the whole batch)."""
    if runner is None or runner.engine.image_processor is not None:
        return requests
    images = {j for j, k in enumerate(requests.runnable) if isinstance(rows.prompts[k], dict)}
    if not images:
        return requests
    errors = dict(requests.errors) | {requests.runnable[j]: "this row has images but the model is text-only (it "
                                      "takes no images); run a vision-language model (e.g. LLaVA-1.5)"
                                      for j in images}
    keep = [j for j in range(len(requests.runnable)) if j not in images]
    return RowRequests(errors, [requests.runnable[j] for j in keep], [requests.params[j] for j in keep])


def generate_rows(engine: LLMEngine | EngineLoop | ShardRunner | None, rows: ShardRows, cfg: RunConfig,
                  progress: ProgressFn | None = None, *, on_row: RowFn | None = None,
                  should_stop: Callable[[], bool] | None = None, clock: DeviceClock | None = None,
                  requests: RowRequests | None = None) -> list[RequestOutput]:
    """One RequestOutput per row, in row order. Bad rows (null, empty, too long, a request error from the input,
    out-of-range per-row sampling values) become error outputs; the others run each with the job's sampling and its
    own values put in (pipeline.row_options): submitted to `engine` when it is a resident engine loop
    (engine.loop.engine_loop: other shards' rows may share its batch), else as one `LLMEngine.generate` call on an
    engine this caller holds alone. `requests`: row_requests(rows, cfg) when the caller has it already. `engine`
    may be None when no row can run (every one an error row): nothing is generated.

    `on_row(k, output)` is called once per finished row k (an index into `rows`), bad rows first, as it finishes,
    in the calling thread (never on the engine's step thread): the checkpoint hook. `should_stop` is polled by the
    loop before every step: once it returns True, this shard's unfinished rows come back with finish_reason "abort"
    (and are not passed to `on_row` or `progress`); other shards' rows go on. When `on_row` or `progress` raises (a
    checkpoint commit that failed after its retries), this shard's rows are stopped the same way, so the engine is
    left clean, and the error is raised once they are. `clock`: bill this shard's share of the engine's steps to
    it (engine.loop.clock.DeviceClock). Raises ValueError when `engine` is None and a row can run.
    """
    from pipeline.shard_engine import ShardRunner

    runner = ShardRunner.of(engine)
    requests = _text_only(requests or row_requests(rows, cfg), rows, runner)
    runnable, params = requests.runnable, requests.params
    if runner is None and runnable:
        raise ValueError(f"{len(runnable)} rows can run but no engine was given")
    outputs: dict[int, RequestOutput] = {}
    for k, problem in requests.errors.items():
        outputs[k] = RequestOutput(rows.ids[k], [], [], "", "error", error=problem)
        if on_row:
            on_row(k, outputs[k])
    if progress and outputs:
        progress(len(outputs), 0)

    def on_output(k: int, out: RequestOutput) -> None:
        out.request_id = rows.ids[k]
        if on_row:
            on_row(k, out)
        if progress:
            progress(1, completion_tokens(out))

    prompts, ids = [rows.prompts[k] for k in runnable], [str(k) for k in runnable]
    generated: list[RequestOutput] = []
    if runnable and runner is not None:  # None with rows to run was refused above
        # An exception in on_output (a failed checkpoint commit) stops this shard's rows, then propagates.
        generated = runner.generate(prompts, params, ids, cfg, lambda j, out: on_output(runnable[j], out),
                                    should_stop, clock)
    for k, out in zip(runnable, generated, strict=True):
        out.request_id = rows.ids[k]
        outputs[k] = out
    return [outputs[k] for k in range(len(rows.prompts))]
