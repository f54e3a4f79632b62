"""Run a job: plan shards, run them as Dask tasks with the engine resident per worker, gather accounting."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dask
from distributed import Client, LocalCluster, as_completed, get_worker

from engine import EngineConfig
from jobs.errors import JobError
from jobs.plugin import EnginePlugin, default_torch_threads, get_engine, register_engine
from pipeline.config import InputError, RunConfig
from pipeline.input import Shard, plan_shards, resolve_inputs, validate_columns
from pipeline.shard import committed_accounting, results_path, run_shard
from pipeline.storage import commit_json, output_fs

PROGRESS_TOPIC = "tokenmill-progress"
PROGRESS_INTERVAL_S = 0.5
SUCCESS_NAME = "_SUCCESS"

# Called with (rows finished, output tokens) as workers report progress, on the client's thread.
ProgressFn = Callable[[int, int], None]


@dataclass
class JobSummary:
    """What a job did, rolled up over its shards (tokens, seconds, USD)."""

    shards: int = 0
    shards_ok: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # shard id -> error
    rows: int = 0
    rows_ok: int = 0
    rows_error: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    device_s: float = 0.0
    cost_usd: float = 0.0
    wall_s: float = 0.0

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens per second of job wall time."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_dollar(self) -> float | None:
        """Output tokens per USD of device time; None when nothing was billed."""
        return self.output_tokens / self.cost_usd if self.cost_usd > 0 else None

    def add(self, row: dict[str, Any]) -> None:
        """Fold one shard's accounting row in."""
        self.shards_ok += 1
        for k in ("rows", "rows_ok", "rows_error", "input_tokens", "output_tokens"):
            setattr(self, k, getattr(self, k) + int(row[k]))
        self.device_s += float(row["wall_s"])
        self.cost_usd += float(row["cost_usd"])

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {"shards": self.shards, "shards_ok": self.shards_ok, "shards_failed": len(self.failed),
                "failed": self.failed, "rows": self.rows, "rows_ok": self.rows_ok, "rows_error": self.rows_error,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "wall_s": round(self.wall_s, 3), "device_s": round(self.device_s, 3),
                "output_tokens_per_s": round(self.output_tokens_per_s, 2), "cost_usd": round(self.cost_usd, 6),
                "tokens_per_dollar": None if self.tokens_per_dollar is None else round(self.tokens_per_dollar, 1)}


def shard_task(shard: Shard, prompt_column: str, output_url: str, cfg: RunConfig, plugin_name: str,
               run_id: str) -> dict[str, Any]:
    """Dask task: one shard on this worker's resident engine (the plugin `plugin_name`); reports progress as worker
    events on PROGRESS_TOPIC, tagged with `run_id` and the shard id. Returns the shard's accounting row; raises what
    run_shard raises."""
    worker = get_worker()
    pending = [0, 0]
    last = [time.monotonic()]

    def flush() -> None:
        worker.log_event(PROGRESS_TOPIC, {"run": run_id, "shard": shard.shard_id, "rows": pending[0],
                                          "tokens": pending[1]})
        pending[0] = pending[1] = 0
        last[0] = time.monotonic()

    def progress(rows: int, tokens: int) -> None:
        pending[0] += rows
        pending[1] += tokens
        if time.monotonic() - last[0] >= PROGRESS_INTERVAL_S:
            flush()

    row = run_shard(get_engine(plugin_name), shard, prompt_column, output_url, cfg, progress=progress)
    if pending[0] or pending[1]:
        flush()
    return row


class _Progress:
    """Folds workers' progress events and finished shards into one (rows, output tokens) stream for `on_progress`.

    Events travel worker -> scheduler -> client and may arrive after the shard's result; a finished shard is topped
    up to its committed totals and its late events are dropped, so the stream ends at exactly the job's totals.
    """

    def __init__(self, run_id: str, on_progress: ProgressFn | None) -> None:
        self.run_id = run_id
        self.on_progress = on_progress
        self.reported: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()

    def event(self, event: tuple[float, dict[str, Any]]) -> None:
        msg = event[1]
        if msg.get("run") != self.run_id:
            return  # another job on a shared cluster
        with self.lock:
            if msg["shard"] in self.finished:
                return
            seen = self.reported.setdefault(msg["shard"], [0, 0])
            seen[0] += msg["rows"]
            seen[1] += msg["tokens"]
        self._emit(msg["rows"], msg["tokens"])

    def finish(self, shard_id: str, rows: int, tokens: int) -> None:
        with self.lock:
            self.finished.add(shard_id)
            seen = self.reported.pop(shard_id, [0, 0])
        self._emit(max(0, rows - seen[0]), max(0, tokens - seen[1]))

    def _emit(self, rows: int, tokens: int) -> None:
        if self.on_progress and (rows or tokens):
            self.on_progress(rows, tokens)


def plan_job(input_url: str, cfg: RunConfig) -> tuple[str, list[Shard]]:
    """Validate the input and cut it into shards, before any cluster starts. Raises JobError (exit code 2)."""
    try:
        fs, files = resolve_inputs(input_url)
        prompt_column = validate_columns(fs, files, cfg)
        shards = plan_shards(fs, files, cfg)
    except InputError as e:
        raise JobError(str(e)) from e
    if not shards:
        raise JobError(f"{input_url} holds no rows")
    return prompt_column, shards


def run_job(input_url: str, output_url: str, cfg: RunConfig, *, model: str | None = None,
            engine_config: EngineConfig | None = None, workers: int = 1, scheduler_address: str | None = None,
            on_start: Callable[[int], None] | None = None, on_progress: ProgressFn | None = None) -> JobSummary:
    """Run every shard of the input and commit results and accounting under output_url.

    With no scheduler address, a LocalCluster of `workers` worker processes (one thread each) runs the shards;
    otherwise the Dask cluster at `scheduler_address` (tcp://host:8786). A shard that fails is recorded in the
    summary; the others go on. Shards already committed under output_url (a rerun, a resumed job) are not run
    again: their committed accounting is counted. When no shard failed, OUTPUT/_SUCCESS is committed last.
    `on_start` gets the total row count; `on_progress` (rows, output tokens) as rows finish.
    Raises JobError (exit code 2) for bad input, before any work.
    """
    if workers < 1:
        raise JobError(f"--workers must be >= 1, got {workers}")
    prompt_column, shards = plan_job(input_url, cfg)
    if on_start:
        on_start(sum(s.num_rows for s in shards))
    summary = JobSummary(shards=len(shards))
    t0 = time.perf_counter()
    progress = _Progress(uuid.uuid4().hex[:8], on_progress)
    # A rerun into the same OUTPUT skips committed shards without starting a cluster or loading a model.
    todo = []
    for shard in shards:
        committed = committed_accounting(output_url, shard.shard_id)
        if committed is None:
            todo.append(shard)
        else:
            summary.add(committed)
            progress.finish(shard.shard_id, int(committed["rows"]), int(committed["output_tokens"]))
    if not todo:
        return _finish(summary, t0, output_url, shards)
    # Spot fleets lose workers: let a shard outlive several dead workers before Dask gives up on it.
    with dask.config.set({"distributed.scheduler.allowed-failures": 10}):
        cluster = None if scheduler_address else LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
            silence_logs=logging.ERROR)
        try:
            with Client(scheduler_address or cluster) as client:
                plugin_name = register_engine(client, EnginePlugin(
                    model, engine_config or EngineConfig(), default_torch_threads(workers) if cluster else None))
                client.subscribe_topic(PROGRESS_TOPIC, progress.event)
                futures = {client.submit(shard_task, s, prompt_column, output_url, cfg, plugin_name, progress.run_id,
                                         pure=False, key=f"shard-{s.shard_id}-{progress.run_id}"): s for s in todo}
                for fut in as_completed(futures):
                    shard = futures[fut]
                    try:
                        row = fut.result()
                    except Exception as e:  # noqa: BLE001 - one failed shard never fails the others
                        summary.failed[shard.shard_id] = f"{type(e).__name__}: {e}"
                        progress.finish(shard.shard_id, shard.num_rows, 0)
                        continue
                    summary.add(row)
                    progress.finish(shard.shard_id, int(row["rows"]), int(row["output_tokens"]))
                client.unsubscribe_topic(PROGRESS_TOPIC)
        finally:
            if cluster is not None:
                cluster.close()
    return _finish(summary, t0, output_url, shards)


def _finish(summary: JobSummary, t0: float, output_url: str, shards: list[Shard]) -> JobSummary:
    """Stamp the wall time; when every shard is committed, commit OUTPUT/_SUCCESS (the job manifest: its shards and
    totals; paths relative to OUTPUT). Readers trust a job's output only once _SUCCESS exists."""
    summary.wall_s = time.perf_counter() - t0
    if not summary.failed:
        fs, root = output_fs(output_url)
        commit_json(fs, f"{root}/{SUCCESS_NAME}", {
            "shards": [{"shard_id": s.shard_id, "input": s.url, "row_start": s.row_start, "row_end": s.row_end,
                        "results": results_path(".", s.shard_id)[2:]} for s in shards],
            "summary": summary.as_dict()})
    return summary
