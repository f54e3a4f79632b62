"""Looking at and steering a job from outside it: `status` (what is done, running, failed, at what cost) and
`cancel` (stop it), both from what is committed under OUTPUT alone, with no access to the run or its cluster.

Records under OUTPUT that this module reads or writes (all JSON, create-only; paths from pipeline.layout):
    _manifest/input.json            the pinned input (pipeline.manifest): which shards the job has
    _manifest/model.json            the pinned model (pipeline.model_pin): shown by `status`
    _CANCEL                         the cancel marker: running shards stop at their next poll and commit what finished
    _manifest/cancel-<n>.json       a cancel marker set aside by `run/submit --resume` (the marker itself is deleted)
    _lease/<seq>.json               who runs the job until when (jobs.lease)
    _SUCCESS                        the job manifest, committed when every shard is (jobs.runner)
"""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import fsspec
import pyarrow.parquet as pq

from jobs.errors import (
    EXIT_CANCELLED,
    EXIT_FAILED_SHARDS,
    EXIT_INCOMPLETE,
    EXIT_LEASE_HELD,
    EXIT_OK,
    JobError,
)
from jobs.lease import holder_gone, newest_record
from jobs.summary import add_accounting
from pipeline.accounting import PerDollar, tokens_per_dollar
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.layout import (
    MANIFEST,
    cancel_aside_path,
    cancel_path,
    is_cancel_aside,
    manifest_dir,
    results_path,
    success_path,
)
from pipeline.manifest import InputManifest, read_manifest
from pipeline.model_pin import read_model_pin
from pipeline.record import ShardRecord
from pipeline.row_kinds import results_task
from pipeline.status import ShardState, shard_state
from pipeline.storage import commit_json, exists_now, list_folder, output_fs, read_fs, read_json

STATES = ("done", "running", "partial", "failed", "pending")
# Shards whose state status reads at once (each is a few small listings of the store).
STATUS_THREADS = 16


def _root(output_url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(output_url)
    return fs, root.rstrip("/")


def job_done(output_url: str) -> bool:
    """True when OUTPUT/_SUCCESS exists: every shard of the job is committed."""
    fs, root = _root(output_url)
    return exists_now(fs, success_path(root))


def read_success(output_url: str) -> dict[str, Any]:
    """The committed job manifest OUTPUT/_SUCCESS (shards and summary). Raises FileNotFoundError when absent."""
    fs, root = _root(output_url)
    return read_json(fs, success_path(root))


def cancel_record(output_url: str) -> dict[str, Any] | None:
    """The cancel marker's content ({} if unreadable) when the job is cancelled, else None."""
    fs, root = _root(output_url)
    path = cancel_path(root)
    if not exists_now(fs, path):
        return None
    try:
        doc = read_json(fs, path)
    except (FileNotFoundError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def cancel_job(output_url: str, reason: str | None = None) -> str:
    """Commit the cancel marker OUTPUT/_CANCEL (create-only): every running shard of the job stops at its next
    poll (TOKENMILL_STOP_POLL_S, default 5 s), commits its finished rows and ends; queued shards do not start.
    Returns a sentence saying what happened (cancelled now, already cancelled, or already finished: a finished job
    is left alone). Raises JobError (exit 2) when no job ever started at OUTPUT."""
    if job_done(output_url):
        return f"the job at {output_url} has already finished; nothing to cancel"
    if read_manifest(output_url) is None:
        raise JobError(f"no tokenmill job at {output_url} (no {MANIFEST}); nothing to cancel")
    fs, root = output_fs(output_url)
    record = {"cancelled_at": datetime.now(UTC).isoformat(timespec="seconds"),
              "by": f"{socket.gethostname()}:{os.getpid()}", "reason": reason}
    if commit_json(fs, cancel_path(root), record):
        return (f"cancelled the job at {output_url}: running shards stop at their next poll and commit what they "
                "finished; resume it with `--resume`")
    earlier = cancel_record(output_url) or {}
    return f"the job at {output_url} was already cancelled (at {earlier.get('cancelled_at', '?')})"


def resume_cancelled(output_url: str) -> dict[str, Any] | None:
    """Lift a cancel: set the marker aside as OUTPUT/_manifest/cancel-<n>.json (create-only), then delete
    OUTPUT/_CANCEL so shards run again. Returns the lifted marker's content, or None when the job was not cancelled.
    Call it holding the job's lease."""
    record = cancel_record(output_url)
    if record is None:
        return None
    fs, root = output_fs(output_url)
    n = len([e for e in list_folder(fs, manifest_dir(root)) if is_cancel_aside(e["name"])])
    while not commit_json(fs, cancel_aside_path(root, n),
                          {**record, "resumed_at": datetime.now(UTC).isoformat(timespec="seconds")}):
        n += 1
    fs.rm_file(cancel_path(root))
    return record


def shard_states(output_url: str, shards: list[Shard]) -> list[ShardState]:
    """pipeline.status.shard_state of each shard, in order, STATUS_THREADS at a time."""
    with ThreadPoolExecutor(STATUS_THREADS) as pool:
        return list(pool.map(lambda s: shard_state(output_url, s.shard_id), shards))


@dataclass
class JobStatus(PerDollar):
    """A job's state from what is committed under OUTPUT.

    `state` is one of done (OUTPUT/_SUCCESS is committed: the only seal), running (a run holds the lease), unsealed
    (every shard committed but no _SUCCESS: a run stopped before sealing it; the same command seals it), failed
    (failed shards, no run holding the job), cancelled, incomplete (pending or partial shards, no run holding the
    job); `exit_code` maps it (jobs.errors: 5 for unsealed as for incomplete). `device_s_unfinished`: device-seconds
    the attempts of shards not done have held so far (failed, stopped or killed ones, billed from their records:
    pipeline.record.ShardRecord.bill_unfinished). `cost_usd`: the committed shards' accounting, plus the failed
    shards' attempts as a run's summary bills them (ShardRecord.unfinished_bill): one bill whichever command shows
    it; other unfinished shards' attempts are billed when they finish.
    Token counts in tokens, cost in USD, device_s_lost in device-seconds. `dtypes` and `quantizations`: the distinct
    torch dtypes and weight quantizations the done shards ran in (jobs.summary.JobSummary's). `model`: the pinned
    model (pipeline.model_pin: model, resolved, fingerprint, pinned_at, files), None for a job started before models
    were pinned. `task`: generate, embed, classify or score, read from a done shard's results columns
    (pipeline.row_kinds.results_task; the manifest does not pin it); None until a shard is done.
    """

    output: str
    state: str
    exit_code: int
    input: str
    started_at: str
    shards: dict[str, int]
    rows: int
    rows_committed: int
    input_tokens: int = 0
    images: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    attempts: int = 0
    preemptions: int = 0
    device_s_lost: float = 0.0
    device_s_unfinished: float = 0.0
    lease: dict[str, Any] | None = None
    cancelled: dict[str, Any] | None = None
    failed: dict[str, str] = field(default_factory=dict)
    shard_states: dict[str, str] = field(default_factory=dict)
    dtypes: list[str] = field(default_factory=list)
    quantizations: list[str] = field(default_factory=list)
    model: dict[str, Any] | None = None
    task: str | None = None

    @property
    def rows_per_dollar(self) -> float | None:
        """Rows committed per USD billed (the committed shards' and the failed ones' cost_usd); None when nothing was
        billed. Output and input tokens per USD: PerDollar's, of the committed shards' tokens."""
        return tokens_per_dollar(self.rows_committed, self.cost_usd)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"output": self.output, "state": self.state, "exit_code": self.exit_code, "input": self.input,
                "started_at": self.started_at, "shards": self.shards, "rows": self.rows,
                "rows_committed": self.rows_committed, "input_tokens": self.input_tokens, "images": self.images,
                "output_tokens": self.output_tokens, "cost_usd": round(self.cost_usd, 6),
                **self.per_dollar(), "attempts": self.attempts,
                "preemptions": self.preemptions, "device_s_lost": round(self.device_s_lost, 3),
                "device_s_unfinished": round(self.device_s_unfinished, 3), "lease": self.lease,
                "cancelled": self.cancelled, "failed": self.failed, "shard_states": self.shard_states,
                "dtypes": self.dtypes, "quantizations": self.quantizations, "model": self.model, "task": self.task}


def job_status(output_url: str) -> JobStatus:
    """The job's status: shards by state, rows, tokens, cost, attempts, who holds it, whether it was cancelled,
    the pinned model.

    Reads the pinned manifest, then each shard's state (pipeline.status.shard_state, STATUS_THREADS at a time).
    Raises JobError (exit 2) when no job ever started at OUTPUT.
    """
    manifest: InputManifest | None = read_manifest(output_url)
    if manifest is None:
        raise JobError(f"no tokenmill job at {output_url} (no {MANIFEST}); start one with `tokenmill run` or "
                       "`tokenmill submit`")
    shards = manifest.shards()
    states = shard_states(output_url, shards)
    counts = dict.fromkeys(STATES, 0)
    status = JobStatus(output_url, "", EXIT_OK, manifest.input, manifest.created_at, counts,
                       sum(s.num_rows for s in shards), 0)
    for shard, st in zip(shards, states, strict=True):
        counts[st.state] = counts.get(st.state, 0) + 1
        status.shard_states[shard.shard_id] = st.state
        status.rows_committed += st.rows_committed
        status.attempts += st.attempts
        if st.state == "failed":
            status.failed[shard.shard_id] = st.last_error or "failed"
        row = st.accounting
        if row:
            add_accounting(status, row)
        elif st.attempts:
            device_s, cost = _unfinished_bill(output_url, shard.shard_id)
            status.device_s_unfinished += device_s
            if st.state == "failed":  # billed as the run's summary bills it (jobs.cluster.fail_shard)
                status.cost_usd += cost
    lease = newest_record(output_url)
    if lease is not None and lease.active() and not holder_gone(lease.holder):
        status.lease = {"holder": lease.holder, "expires_at": lease.expires_at,
                        "expires_in_s": round(lease.expires_at - time.time(), 1)}
    status.cancelled = cancel_record(output_url)
    pin = read_model_pin(output_url)
    status.model = None if pin is None else pin.as_json()
    status.state, status.exit_code = _overall(status, job_done(output_url))
    done = [shard.shard_id for shard, st in zip(shards, states, strict=True) if st.state == "done"]
    status.task = _results_task(output_url, done[0]) if done else None
    return status


def _results_task(output_url: str, shard_id: str) -> str | None:
    """The task of the job at OUTPUT from the columns of the done shard `shard_id`'s results (its Parquet footer
    only; pipeline.row_kinds.results_task); None when they cannot be read."""
    fs, root = read_fs(output_url)
    try:
        with fs.open(results_path(root, shard_id), "rb") as f:
            return results_task(pq.read_schema(f).names)
    except OSError:
        return None


def _unfinished_bill(output_url: str, shard_id: str) -> tuple[float, float]:
    """(device-seconds, USD) of the attempts of an unfinished shard (pipeline.record.ShardRecord.unfinished_bill,
    at the price their run recorded)."""
    defaults = RunConfig()
    return ShardRecord.read(output_url, shard_id).unfinished_bill(defaults.checkpoint_seconds,
                                                                  defaults.price_per_hour_usd)


def _overall(status: JobStatus, done: bool) -> tuple[str, int]:
    if done:  # only _SUCCESS seals a job: readers trust nothing else
        return "done", EXIT_OK
    if status.lease is not None:
        return "running", EXIT_LEASE_HELD
    if status.shards["done"] == sum(status.shards.values()):
        return "unsealed", EXIT_INCOMPLETE  # every shard committed, the run stopped before _SUCCESS
    if status.shards["failed"]:
        return "failed", EXIT_FAILED_SHARDS
    if status.cancelled is not None:
        return "cancelled", EXIT_CANCELLED
    return "incomplete", EXIT_INCOMPLETE
