"""Run a job: pin its input, take its lease, plan the shards still to do, run them as Dask tasks with the engine
resident per worker (jobs.cluster: lost workers and preempted shards survived there), gather accounting, commit
_SUCCESS.

A job is identified by its OUTPUT. Running it again (same options) resumes it: finished shards are skipped, partial
ones resume from their checkpoints (pipeline.shard.run_shard), and a finished job is a no-op.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
from fsspec import AbstractFileSystem

from engine import EngineConfig
from jobs.cluster import ClusterOptions, RunContext, run_on_cluster
from jobs.control import cancel_record, job_done, read_success, resume_cancelled, shard_states
from jobs.errors import EXIT_CANCELLED, EXIT_LEASE_HELD, JobError
from jobs.lease import Lease, LeaseHeld
from jobs.summary import JobProgress, JobSummary
from jobs.task import record_failure
from pipeline.config import InputError, RunConfig
from pipeline.input import Shard, validate_columns
from pipeline.layout import results_path, success_path
from pipeline.manifest import (
    InputManifest,
    build_manifest,
    changed_inputs,
    check_compatible,
    commit_revision,
    input_changes,
    pin_manifest,
    read_manifest,
    repinned,
)
from pipeline.model_pin import ModelPin, check_model_pin, fingerprint_model, pin_model, read_model_pin
from pipeline.record import ShardRecord
from pipeline.shard import ProgressFn
from pipeline.storage import commit_json, output_fs

log = logging.getLogger(__name__)


def _manifest_or_error(input_url: str, output_url: str, cfg: RunConfig,
                       built: InputManifest | None) -> tuple[InputManifest, bool]:
    """The job's pinned manifest and whether this call pinned it (pipeline.manifest.pin_manifest). Raises JobError."""
    try:
        manifest, created = pin_manifest(output_url, input_url, cfg, built)
    except InputError as e:
        raise JobError(str(e)) from e
    if not manifest.shards():
        raise JobError(f"{input_url} holds no rows")
    return manifest, created


def _check_before_start(input_url: str, output_url: str, cfg: RunConfig) -> JobSummary | InputManifest | None:
    """Checks that need no lease and write nothing: a finished job's summary (from _SUCCESS) when OUTPUT holds one
    with these options; at a first start, the manifest to pin (the input listed and its columns checked); else
    None. Raises JobError (exit 2) for bad input or options that differ from the job under OUTPUT."""
    manifest = read_manifest(output_url)
    try:
        if manifest is None:
            built = build_manifest(input_url, cfg)
            if not built.shards():
                raise JobError(f"{input_url} holds no rows")
            return built
        check_compatible(manifest, input_url, cfg, output_url)
    except InputError as e:
        raise JobError(str(e)) from e
    if not job_done(output_url):
        return None
    done = read_success(output_url)["summary"]
    summary = JobSummary(already_done=True)
    for k, v in done.items():
        if k in JobSummary.__dataclass_fields__ and k not in ("wall_s", "already_done", "cancelled", "run_rows",
                                                              "run_output_tokens", "inputs_skipped"):
            setattr(summary, k, type(getattr(summary, k))(v) if v is not None else v)
    summary.inputs_changed = input_changes(manifest)  # said, never run: the results are of the pinned input
    return summary


def _model_now(model: str | None, output_url: str) -> ModelPin:
    """The model as it is now (pipeline.model_pin.fingerprint_model: sizes and cached hashes, or ETags), checked
    against the one the job at `output_url` pinned, if any: before the lease is taken, so a changed model is refused
    with nothing written. Raises JobError (exit 2) naming what changed and the two ways out."""
    try:
        now = fingerprint_model(model)
        pinned = read_model_pin(output_url)
        if pinned is not None:
            check_model_pin(pinned, now, output_url)
    except InputError as e:
        raise JobError(str(e)) from e
    return now


def _pin_model_or_error(output_url: str, now: ModelPin, input_pinned_now: bool) -> tuple[ModelPin, str]:
    """Pin `now` as the job's model when it has none, else check it against the pinned one (a racing run may have
    pinned another). Call it holding the lease. Returns (the pin, a note: "" unless this run pinned the model of a
    job whose input was pinned earlier, by a tokenmill that did not pin models; the note is logged too).
    Raises JobError (exit 2) when the models differ."""
    try:
        pinned, created = pin_model(output_url, now)
    except InputError as e:
        raise JobError(str(e)) from e
    note = ""
    if created and not input_pinned_now:
        note = (f"the job at {output_url} was started by a tokenmill that did not pin its model: pinned "
                f"{now.describe()} now; rows committed before this run carry no model_fingerprint")
        log.warning("%s", note)
    return pinned, note


def run_job(input_url: str, output_url: str, cfg: RunConfig, *, model: str | None = None,
            engine_config: EngineConfig | None = None, workers: int = 1, scheduler_address: str | None = None,
            gpus_per_worker: int = 0, shard_slots: int | None = None, resume: bool = False,
            lease_ttl_s: float | None = None, on_start: Callable[[int], None] | None = None,
            on_progress: ProgressFn | None = None) -> JobSummary:
    """Run (or resume) the job that writes `input_url`'s completions under `output_url`.

    Steps: a finished job (OUTPUT/_SUCCESS) returns its summary with `already_done` and runs nothing, even when its
    input changed since (summary.inputs_changed says how, for the caller to warn). Otherwise
    the run takes the job's lease (jobs.lease; LeaseHeld, exit 3, when another run holds it), pins the input
    manifest at the first start or checks these options against the pinned one (exit 2 when they differ), refuses
    a cancelled job unless `resume` (exit 4), skips committed shards, fails the shards of input files changed since
    the job started, and runs the rest as Dask tasks (jobs.cluster.run_on_cluster): on the LocalCluster of `workers`
    processes, or on the cluster at `scheduler_address`; each worker runs `shard_slots` shards at once on its one
    engine (None: enough to keep its batch full; jobs.cluster.ClusterOptions). Shards of a dead worker run again
    elsewhere (Dask, up to jobs.cluster.ALLOWED_FAILURES on a LocalCluster; set
    distributed.scheduler.allowed-failures on your scheduler);
    interrupted shards (ShardInterrupted: SIGTERM or a spot notice on their worker) are submitted again, up to
    jobs.cluster.MAX_INTERRUPTIONS times each; both resume from their last checkpoint. A cancel (OUTPUT/_CANCEL)
    stops running shards and drops queued ones. A failed shard never stops the others. When every shard is
    committed, OUTPUT/_SUCCESS is committed last. `on_start` gets the total row count; `on_progress` (rows, output
    tokens) as rows finish.

    The model is pinned as the input is (pipeline.model_pin, OUTPUT/_manifest/model.json, at the first start; a job
    started before models were pinned gets its pin at this run, said in summary.model_note): a run whose model
    differs is refused before any work, and each worker checks the model it loaded before each shard.

    Raises JobError: exit 2 (bad input, options or model, before any work; or no GPU worker joined the cluster in
    time, jobs.cluster.run_on_cluster), 3 (lease held, or lost mid-run), 4 (cancelled, and not `resume`).
    """
    cluster_opts = ClusterOptions(scheduler_address, workers, gpus_per_worker, shard_slots)
    checked = _check_before_start(input_url, output_url, cfg)
    if isinstance(checked, JobSummary):
        if on_start:
            on_start(checked.rows)
        return checked
    model_now = _model_now(model, output_url)
    t0 = time.perf_counter()
    with _lease_or_mismatch(input_url, output_url, cfg, lease_ttl_s) as lease:
        manifest, pinned_now = _manifest_or_error(input_url, output_url, cfg, checked)
        model_pin, model_note = _pin_model_or_error(output_url, model_now, pinned_now)
        if (cancelled := cancel_record(output_url)) is not None:
            if not resume:
                when = cancelled.get("cancelled_at", "?")
                raise JobError(f"the job at {output_url} was cancelled (at {when}); run it with --resume to go on",
                               exit_code=EXIT_CANCELLED)
            resume_cancelled(output_url)
        repinned: list[str] = []
        changed: dict[str, str] = {}
        if not pinned_now:  # a manifest pinned just now was built from the files as they are
            manifest, repinned, changed = _repin_unstarted_inputs(output_url, manifest, cfg)
        shards = manifest.shards()
        if on_start:
            on_start(sum(s.num_rows for s in shards))
        summary = JobSummary(shards=len(shards), repinned=repinned, model_note=model_note, task=cfg.task,
                             inputs_skipped=list(manifest.skipped) if pinned_now else [])
        progress = JobProgress(uuid.uuid4().hex[:8], on_progress)
        progress.sizes = {s.shard_id: s.num_rows for s in shards}
        todo = _skip_committed(output_url, shards, summary, progress)
        if todo and changed:
            todo = _fail_changed_inputs(output_url, changed, todo, summary, progress)
        if todo:
            run = RunContext(output_url, cfg, manifest.prompt_column, {f.url: f for f in manifest.files}, summary,
                             progress, lease, model_pin)
            run_on_cluster(todo, run, model, engine_config or EngineConfig(), cluster_opts)
        if lease.lost.is_set():
            raise JobError(f"this run lost the job's lease at {output_url} to another run and stopped",
                           exit_code=EXIT_LEASE_HELD)
        return _finish(summary, t0, output_url, shards)


@contextmanager
def _lease_or_mismatch(input_url: str, output_url: str, cfg: RunConfig, ttl_s: float | None) -> Iterator[Lease]:
    """Hold the job's lease (jobs.lease.Lease) for the `with` block. When another run holds it and the manifest that
    run pinned meanwhile names another input or other options, the mismatch is the error (exit 2), said at once:
    waiting for that run would only lead to it. Raises LeaseHeld (exit 3) otherwise."""
    try:
        lease = Lease(output_url, ttl_s=ttl_s).__enter__()
    except LeaseHeld as held:
        pinned = read_manifest(output_url)
        if pinned is not None:
            try:
                check_compatible(pinned, input_url, cfg, output_url)
            except InputError as e:
                raise JobError(f"{e} (another run holds the job now: {held.record.describe()})") from None
        raise
    try:
        yield lease
    finally:
        lease.__exit__(None, None, None)


def _skip_committed(output_url: str, shards: list[Shard], summary: JobSummary, progress: JobProgress) -> list[Shard]:
    """Fold the committed shards' accounting into the summary; return the others."""
    todo = []
    for shard, state in zip(shards, shard_states(output_url, shards), strict=True):
        if state.state == "done" and state.accounting is not None:
            summary.add(state.accounting, this_run=False)
            # Rows committed by an earlier run: counted as done, but their tokens are not this run's throughput.
            progress.finish(shard.shard_id, int(state.accounting["rows"]), 0)
        else:
            todo.append(shard)
    return todo


def _has_commits(fs: AbstractFileSystem, root: str, shard_id: str) -> bool:
    """Whether the shard committed anything: its results or a checkpoint part."""
    record = ShardRecord(fs, root, shard_id)
    return record.results_committed or bool(record.parts)


def _repin_unstarted_inputs(output_url: str, manifest: InputManifest,
                            cfg: RunConfig) -> tuple[InputManifest, list[str], dict[str, str]]:
    """Re-pin the changed input files none of whose shards committed anything (a corrupt file fixed or removed since
    its shard failed), so a job with one bad file can finish in place: a new manifest revision, create-only
    (pipeline.manifest.commit_revision). A changed file stays pinned, its unfinished shards to fail, when a shard of it
    committed rows (they came from the old content), when its prompt column no longer fits the job, or when
    re-pinning would move the shards of other files (`--limit` spreads rows over files in order).

    Returns (the manifest now pinned, the files re-pinned, url -> why for the changed files that stay pinned).
    Transient storage errors are retried, then raised."""
    changed = changed_inputs(manifest)
    if not changed:
        return manifest, [], {}
    fs, root = output_fs(output_url)
    old = manifest.shards()
    kept: dict[str, str] = {}
    free: list[str] = []
    for url, why in changed.items():
        if any(_has_commits(fs, root, s.shard_id) for s in old if s.url == url):
            kept[url] = f"{why} (rows of it are committed under OUTPUT, so the job keeps it pinned)"
        elif (problem := _columns_problem(url, manifest.prompt_column, cfg)) is not None:
            kept[url] = f"{why}; it cannot be re-pinned: {problem}"
        else:
            free.append(url)
    if not free:
        return manifest, [], kept
    revised = repinned(manifest, free)
    moved = sorted({s.url for s in set(old) - set(revised.shards()) if s.url not in free})
    if moved:
        note = f"; re-pinning it would move the shards of {', '.join(moved)} (--limit): keep the file as it was"
        return manifest, [], kept | {url: changed[url] + note for url in free}
    why = "; ".join(changed[url] for url in free)
    manifest = commit_revision(output_url, revised, f"re-pinned files none of whose shards committed rows: {why}")
    log.warning("re-pinned %s (manifest revision %d): nothing of them was committed", ", ".join(free),
                manifest.revision)
    return manifest, free, kept


def _columns_problem(url: str, prompt_column: str, cfg: RunConfig) -> str | None:
    """Why the file at `url`, as it is now, cannot join the job's manifest (its prompt column missing or of another
    type or name than `prompt_column`), or None (also when it is gone or unreadable: its shard reports that)."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        return None
    try:
        column = validate_columns(fs, [path], cfg)
    except InputError as e:
        return str(e)
    if column != prompt_column:
        return f"it has prompt column {column!r}; the job reads {prompt_column!r}"
    return None


def _fail_changed_inputs(output_url: str, changed: dict[str, str], todo: list[Shard], summary: JobSummary,
                         progress: JobProgress) -> list[Shard]:
    """Fail (and record as failed) the unfinished shards of the pinned files in `changed` (url -> why); return the
    others."""
    keep = []
    for shard in todo:
        if shard.url in changed:
            attempt = record_failure(output_url, shard.shard_id, changed[shard.url])
            summary.fail(shard.shard_id, f"InputChanged: {changed[shard.url]}", attempt)
            progress.finish(shard.shard_id, shard.num_rows, 0)
        else:
            keep.append(shard)
    return keep


def _finish(summary: JobSummary, t0: float, output_url: str, shards: list[Shard]) -> JobSummary:
    """Stamp the wall time; when every shard is committed, commit OUTPUT/_SUCCESS (the job manifest: its shards and
    totals; paths relative to OUTPUT). Readers trust a job's output only once _SUCCESS exists, so it is committed
    only after checking every shard's results file is there (a shard whose results are not, say written under
    another folder by a worker, fails instead). Null and repeated ids are counted into the summary."""
    summary.wall_s = time.perf_counter() - t0
    if summary.shards_ok == len(shards) and not summary.failed and not summary.stopped:
        fs, root = output_fs(output_url)
        records = [ShardRecord(fs, root, s.shard_id) for s in shards]
        for s, record in zip(shards, records, strict=True):
            if not record.results_committed:
                summary.failed[s.shard_id] = (f"its results are not at {results_path(output_url, s.shard_id)} "
                                              "although its task reported them committed; check that the workers "
                                              "see OUTPUT at the same place as this client, and run the job again")
        if summary.failed:
            summary.shards_ok -= len(summary.failed)
            return summary
        summary.ids_null, summary.ids_repeated = count_ids(records)
        commit_json(fs, success_path(root), {
            "shards": [{"shard_id": s.shard_id, "input": s.url, "row_start": s.row_start, "row_end": s.row_end,
                        "results": results_path("", s.shard_id)} for s in shards],
            "summary": summary.as_dict()})
    return summary


def count_ids(records: list[ShardRecord]) -> tuple[int, int]:
    """(rows with a null id, rows whose id another row has too) over the committed results of the shards of
    `records` (reads only their id column)."""
    ids = pa.chunked_array([r.results(columns=["id"]).column("id") for r in records], pa.string())
    nulls = ids.null_count
    counts = pc.value_counts(ids.drop_null())
    repeated = pc.sum(pc.filter(counts.field("counts"), pc.greater(counts.field("counts"), 1))).as_py() or 0
    return nulls, int(repeated)
