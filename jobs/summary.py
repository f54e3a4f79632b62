"""What a job did (JobSummary, rolled up from shard accounting) and its progress stream (JobProgress, folded from
workers' progress events), for the CLI's bar and summary."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.accounting import PerDollar

if TYPE_CHECKING:  # pipeline.shard loads the engine (torch): `tokenmill status` must not
    from pipeline.shard import ProgressFn


@dataclass
class JobSummary(PerDollar):
    """What a job did, rolled up over its shards (tokens; seconds; USD).

    `device_s` is the device time billed for the committed shards (every attempt, lost time included);
    `attempts`, `preemptions` and `device_s_lost` (device-seconds of work no commit kept) come from their accounting;
    `interruptions` counts shard runs this job saw stop (preemption or cancel). `stopped` maps shards left
    unfinished by a cancel to why; `cancelled` says the job was cancelled; `already_done` that it had finished
    before this run started (nothing ran). `dtypes` and `quantizations` are the distinct torch dtypes ("bfloat16",
    "float32", ...) and weight quantizations (none, auto, int4, int8; for an already quantized model with how its
    layers loaded: pipeline.accounting.quantization_label) the committed shards ran in, sorted: one value
    each unless shards ran under different engines (a shard whose accounting predates these columns adds none).
    `ids_null` and `ids_repeated` count result rows with a null id and rows whose id another row shares (counted
    when _SUCCESS is committed; input_file + input_row tell such rows apart). `repinned`: input files this run
    re-pinned (changed files none of whose shards had committed anything; jobs.runner). `inputs_changed`: for a
    job `already_done`, how its input differs now from what it pinned (pipeline.manifest.input_changes: a file
    changed, gone or new, one entry each); the results stay those of the pinned input. `inputs_skipped`: the files
    of the input folder left out as not Parquet, when this run pinned the job's input (said once: the manifest
    keeps them).

    Rows, tokens, device-seconds and cost are the job's totals: every committed shard, whichever run committed it.
    `wall_s` is this run's wall time, and `run_rows` / `run_output_tokens` what this run generated itself (the
    shards it finished, less the rows they resumed from earlier runs' checkpoints): a rerun of a partly finished job
    reports its own speed from these, not the job's tokens over its own seconds.
    `model_note`: set when this run pinned the model of a job started before models were pinned (what it
    pinned), else "". `task`: the job's task (pipeline.config.RunConfig.task: "generate" or "embed"), which decides
    the measures the summary table shows (an embed job generates no output tokens).
    """

    shards: int = 0
    shards_ok: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # shard id -> error
    stopped: dict[str, str] = field(default_factory=dict)  # shard id -> why it is unfinished
    rows: int = 0
    rows_ok: int = 0
    rows_error: int = 0
    input_tokens: int = 0
    images: int = 0
    output_tokens: int = 0
    device_s: float = 0.0
    cost_usd: float = 0.0
    wall_s: float = 0.0
    attempts: int = 0
    preemptions: int = 0
    device_s_lost: float = 0.0
    interruptions: int = 0
    cancelled: bool = False
    already_done: bool = False
    dtypes: list[str] = field(default_factory=list)
    quantizations: list[str] = field(default_factory=list)
    ids_null: int = 0
    ids_repeated: int = 0
    repinned: list[str] = field(default_factory=list)
    inputs_changed: list[str] = field(default_factory=list)
    inputs_skipped: list[str] = field(default_factory=list)
    run_rows: int = 0
    run_output_tokens: int = 0
    model_note: str = ""
    task: str = "generate"

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens this run generated per second of its wall time."""
        return self.run_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, row: dict[str, Any], *, this_run: bool = True) -> None:
        """Fold one shard's accounting row in; `this_run`: this run finished the shard (its generated rows and
        tokens count as this run's), else an earlier run committed it."""
        if this_run:
            self.run_rows += int(row["rows"]) - int(row.get("rows_resumed") or 0)
            self.run_output_tokens += generated_tokens(row)
        self.shards_ok += 1
        for k in ("rows", "rows_ok", "rows_error"):
            setattr(self, k, getattr(self, k) + int(row[k]))
        billed = row.get("device_s_billed")  # 0.0 for a shard that needed no engine; None before the column
        self.device_s += float(row["wall_s"] if billed is None else billed)
        self.attempts += int(row.get("attempts") or 1)
        add_accounting(self, row)

    def fail(self, shard_id: str, error: str, attempts: int, device_s: float = 0.0, cost_usd: float = 0.0) -> None:
        """Record a failed shard: `error` says what failed; `attempts` is the attempts it has claimed in all;
        `device_s` the device-seconds they held and `cost_usd` their USD (pipeline.record.ShardRecord.unfinished_bill,
        as `tokenmill status` bills them): a failed shard's time is real money too."""
        self.failed[shard_id] = error
        self.attempts += attempts
        self.device_s += device_s
        self.cost_usd += cost_usd

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {"shards": self.shards, "shards_ok": self.shards_ok, "shards_failed": len(self.failed),
                "failed": self.failed, "shards_stopped": len(self.stopped), "stopped": self.stopped,
                "rows": self.rows, "rows_ok": self.rows_ok, "rows_error": self.rows_error,
                "input_tokens": self.input_tokens, "output_tokens": self.output_tokens, "images": self.images,
                "wall_s": round(self.wall_s, 3), "device_s": round(self.device_s, 3),
                "output_tokens_per_s": round(self.output_tokens_per_s, 2), "cost_usd": round(self.cost_usd, 6),
                **self.per_dollar(),
                "attempts": self.attempts, "preemptions": self.preemptions,
                "device_s_lost": round(self.device_s_lost, 3),
                "interruptions": self.interruptions, "cancelled": self.cancelled, "already_done": self.already_done,
                "dtypes": self.dtypes, "quantizations": self.quantizations, "ids_null": self.ids_null,
                "ids_repeated": self.ids_repeated, "repinned": self.repinned,
                "inputs_changed": self.inputs_changed, "inputs_skipped": self.inputs_skipped, "run_rows": self.run_rows,
                "run_output_tokens": self.run_output_tokens, "model_note": self.model_note}


def generated_tokens(row: dict[str, Any]) -> int:
    """Output tokens the finishing attempt of a shard generated itself (its accounting's `generated_tokens`), not
    those of rows it resumed from checkpoints: what this run's progress and speed count. Accounting written before
    that column: output_tokens_per_s x wall_s; without either, all its output tokens."""
    if row.get("generated_tokens") is not None:
        return int(row["generated_tokens"])
    if row.get("output_tokens_per_s") is None:
        return int(row["output_tokens"])
    return round(float(row["output_tokens_per_s"]) * float(row["wall_s"]))


def add_accounting(totals: Any, row: dict[str, Any]) -> None:
    """Fold the totals a job's summary and its status (jobs.control.JobStatus) both keep from a shard's accounting
    row into `totals` (an object with those attributes): input / output tokens, images, cost (USD), preemptions,
    device-seconds lost, and the distinct dtypes and quantizations. The one fold of those fields."""
    totals.input_tokens += int(row["input_tokens"])
    totals.output_tokens += int(row["output_tokens"])
    totals.images += int(row.get("images") or 0)  # null: no images, or accounting written before the column
    totals.cost_usd += float(row["cost_usd"])
    totals.preemptions += int(row.get("preemptions") or 0)
    totals.device_s_lost += float(row.get("device_s_lost") or 0.0)
    add_distinct(totals.dtypes, row.get("dtype"))
    add_distinct(totals.quantizations, row.get("quantization"))


def add_distinct(values: list[str], value: str | None) -> None:
    """Add `value` to the sorted list of distinct `values`, unless it is None (an accounting file written before
    the column existed) or already there."""
    if value is not None and value not in values:
        values.append(value)
        values.sort()


class JobProgress:
    """Folds workers' progress events and finished shards into one (rows, output tokens) stream for `on_progress`.

    Events travel worker -> scheduler -> client and may arrive after the shard's result; a finished shard is topped
    up to its committed totals and its late events are dropped. Rows are capped at the shard's size (an interrupted
    attempt's uncommitted rows are generated, and reported, again), so the stream ends at the job's row total.
    """

    def __init__(self, run_id: str, on_progress: ProgressFn | None) -> None:
        self.run_id = run_id
        self.on_progress = on_progress
        self.reported: dict[str, list[int]] = {}
        self.sizes: dict[str, int] = {}
        self.finished: set[str] = set()
        self.lock = threading.Lock()

    def event(self, event: tuple[float, dict[str, Any]]) -> None:
        """A Dask worker event (timestamp, {"run", "shard", "rows", "tokens"}) from PROGRESS_TOPIC; events of other
        runs and of finished shards are dropped."""
        msg = event[1]
        if msg.get("run") != self.run_id:
            return  # another job on a shared cluster
        with self.lock:
            if msg["shard"] in self.finished:
                return
            seen = self.reported.setdefault(msg["shard"], [0, 0])
            rows = min(msg["rows"], max(0, self.sizes.get(msg["shard"], 1 << 62) - seen[0]))
            seen[0] += rows
            seen[1] += msg["tokens"]
        self._emit(rows, msg["tokens"])

    def finish(self, shard_id: str, rows: int, tokens: int) -> None:
        """Shard `shard_id` committed `rows` rows and `tokens` output tokens in all: emit what its events missed."""
        with self.lock:
            self.finished.add(shard_id)
            seen = self.reported.pop(shard_id, [0, 0])
        self._emit(max(0, rows - seen[0]), max(0, tokens - seen[1]))

    def _emit(self, rows: int, tokens: int) -> None:
        if self.on_progress and (rows or tokens):
            self.on_progress(rows, tokens)
