"""Run a job's shards on a Dask cluster: the cluster (a LocalCluster of ours, or the one at a scheduler address), its
settings and plugins (the engine resident per worker, preemption, draining nannies), the wait for a GPU worker, and
gathering the shards' outcomes into the run's summary: resubmitting interrupted shards, taking preempted workers
out, dropping queued shards on a cancel, stopping on a lost lease.

jobs.runner decides what runs (the pinned input, the lease, the shards still to do) and calls `run_on_cluster`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import dask
from distributed import Client, Future, KilledWorker, LocalCluster, as_completed
from pydantic import ValidationError

from engine import EngineConfig
from jobs.cluster_workers import DASHBOARD_ADDRESS, WORKER_WAIT_ENV, say_dashboard, wait_for_gpu_worker, worker_wait_s
from jobs.control import cancel_record
from jobs.errors import EXIT_FAILED_SHARDS, EXIT_NO_SPACE, JobError
from jobs.lease import Lease
from jobs.local_workers import WorkerKeeper
from jobs.plugin import (
    MAX_SHARD_SLOTS,
    NANNY_CLOSING,
    DrainNannyPlugin,
    EnginePlugin,
    PreemptionPlugin,
    WorkerPreempted,
    default_torch_threads,
    register_engine,
    shard_slots,
)
from jobs.summary import JobProgress, JobSummary, generated_tokens
from jobs.task import PROGRESS_TOPIC, ShardFailed, ShardStopped, shard_task
from pipeline.config import InputError, RunConfig
from pipeline.disk_need import no_space_line
from pipeline.input import Shard
from pipeline.manifest import InputFile
from pipeline.model_pin import ModelPin
from pipeline.record import ShardRecord
from pipeline.shard import ShardInterrupted
from schemas.job_spec import Cluster

log = logging.getLogger(__name__)

# A shard may be interrupted (its worker preempted) this many times, and may outlive this many dead workers,
# before the job gives up on it: spot fleets lose machines.
MAX_INTERRUPTIONS = 10
ALLOWED_FAILURES = 10
# Dask settings of the clusters run_on_cluster starts (and what a real cluster's scheduler and workers should set).
# NOTE: the worker's statistical profiler calls sys._current_frames() every 10 ms, which on CPython 3.11 can deadlock
# the whole worker process against the garbage collector (python/cpython#106883, dask/distributed#8616); we saw a
# worker hang mid-shard with it on. Profiling is for debugging; jobs run without it.
# NOTE: Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536, which turns off glibc's dynamic mmap threshold:
# every activation tensor over 128 KiB is then mmap'd and unmapped again, page faults and all. Measured on the CPU
# path (64 GSM8K rows, 128 tokens): 82 vs 136 output tok/s, 59 vs 3.5 s of system time. None unsets it.
# NOTE: a Dask worker's own periodic work (the event loop's 20 ms tick, the 500 ms system monitor, the 100 ms memory
# monitor) costs an idle worker 23.5 CPU-ms per second on the 2-core AVX2 EPYC, 2.4% of the core its engine steps
# on; at 1 s / 5 s / 1 s it costs 3.9 (bench/README.md, issue 28's drain section). They only time warnings,
# dashboard series and the memory limit's reaction, which an engine whose memory is fixed at load does not need
# at 10 Hz.
CLUSTER_CONFIG = {"distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
                  "distributed.worker.profile.enabled": False,
                  "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
                  "distributed.admin.tick.interval": "1s",
                  "distributed.admin.system-monitor.interval": "5s",
                  "distributed.worker.memory.monitor-interval": "1s"}


@dataclass(frozen=True)
class ClusterOptions:
    """Where shards run.

    Attributes:
        scheduler_address: a Dask scheduler (tcp://host:8786); None starts a LocalCluster of `workers` processes.
        workers: worker processes of the LocalCluster (one engine each).
        gpus_per_worker: GPUs per worker; > 0 makes each shard ask for resources {"GPU": 1 / slots} (LocalCluster
            workers then offer {"GPU": gpus_per_worker}; on a real cluster start workers with `--resources GPU=N`).
        shard_slots: shards one worker runs at once on its one engine (its Dask threads; the LocalCluster's
            threads per worker): their rows share the engine's batch, so it never drains between shards. None:
            jobs.plugin.shard_slots(max_num_seqs, rows_per_shard). On a real cluster start workers with
            `--nthreads` = slots.

    Defaults and checks are the job spec's cluster section (schemas.job_spec.Cluster): raises JobError (exit 2)
    naming the field, e.g. when workers < 1 or gpus_per_worker < 0; and when shard_slots is not a power of two in
    [1, jobs.plugin.MAX_SHARD_SLOTS].
    """

    scheduler_address: str | None = None
    workers: int = Cluster.model_fields["workers"].default
    gpus_per_worker: int = Cluster.model_fields["gpus_per_worker"].default
    shard_slots: int | None = None

    def __post_init__(self) -> None:
        if self.shard_slots is not None and (not 1 <= self.shard_slots <= MAX_SHARD_SLOTS
                                             or self.shard_slots & (self.shard_slots - 1)):
            raise JobError(f"shard_slots must be a power of two from 1 to {MAX_SHARD_SLOTS} (each shard asks for "
                           f"1/slots of a GPU), got {self.shard_slots}")
        try:
            Cluster(scheduler=self.scheduler_address, workers=self.workers, gpus_per_worker=self.gpus_per_worker)
        except ValidationError as e:
            raise JobError("; ".join(f"cluster.{'.'.join(map(str, p['loc']))}: {p['msg']}, got {p['input']!r}"
                                     for p in e.errors())) from None


@dataclass(frozen=True)
class RunContext:
    """What the shards of one run share: where they write, how they run, the input files as pinned, and the
    run's bookkeeping (its summary, progress and lease), which run_on_cluster fills in as shards finish.

    Attributes:
        output_url: the job's OUTPUT.
        cfg: the run's options.
        prompt_column: the column prompts are read from (the pinned manifest's).
        pinned: the pinned input files by URL (a shard checks its file is still the pinned one).
        summary: the run's summary: shards committed, failed, stopped, interruptions.
        progress: the run's progress (its run id names the tasks).
        lease: the job's lease, held by this run; a lost lease stops the waiting.
        model_pin: the job's pinned model (pipeline.model_pin): each worker checks the model it loaded against it
            before running a shard; None checks nothing.
    """

    output_url: str
    cfg: RunConfig
    prompt_column: str
    pinned: dict[str, InputFile]
    summary: JobSummary
    progress: JobProgress
    lease: Lease
    model_pin: ModelPin | None = None


def run_on_cluster(todo: list[Shard], run: RunContext, model: str | None, engine_config: EngineConfig,
                   opts: ClusterOptions) -> None:
    """Run the shards `todo` as Dask tasks, with the engine `model` (`engine_config`) resident per worker, on the
    cluster at opts.scheduler_address, or on a LocalCluster of opts.workers processes started (under
    CLUSTER_CONFIG, its dashboard on a free local port, printed once: say_dashboard; a worker it loses for good is
    replaced, jobs.local_workers, up to MAX_LOST_WORKERS, then JobError exit 1) and closed here. Each shard's
    outcome goes into run.summary and run.progress: a failed shard never stops the others; an interrupted one is
    submitted again, up to MAX_INTERRUPTIONS times; a cancel drops the queued ones; a lost lease stops the waiting.
    Returns when every shard has an outcome. Each worker runs opts.shard_slots shards at once (auto: enough to
    keep max_num_seqs rows in its engine while a shard's tail finishes; jobs.plugin.shard_slots), all on its one
    resident engine loop.

    With opts.gpus_per_worker > 0 each shard asks for resources {"GPU": 1}, and the run first waits up to
    worker_wait_s() seconds (0: no wait) for a worker of the cluster that offers one. Raises JobError (exit 2) when
    none does, or when TOKENMILL_WORKER_WAIT_S is not a number of seconds; what Dask raises when the scheduler
    cannot be reached (OSError) propagates.
    """
    slots = opts.shard_slots or shard_slots(engine_config.max_num_seqs, run.cfg.rows_per_shard)
    # A fraction of the GPU per shard: `slots` shards share the worker's one engine (1/slots is exact in binary).
    resources = {"GPU": 1 / slots} if opts.gpus_per_worker > 0 else None
    # NOTE: the whole cluster's life inside the config: a nanny restarting a killed worker passes the config of now.
    with dask.config.set(CLUSTER_CONFIG):
        cluster = None if opts.scheduler_address else LocalCluster(
            n_workers=opts.workers, threads_per_worker=slots, processes=True, dashboard_address=DASHBOARD_ADDRESS,
            silence_logs=logging.ERROR, resources={"GPU": opts.gpus_per_worker} if resources else None)
        if cluster is not None:
            say_dashboard(cluster.dashboard_link)
        try:
            with Client(opts.scheduler_address or cluster) as client:
                if resources and not wait_for_gpu_worker(client, worker_wait_s()):
                    raise JobError(f"gpus_per_worker is {opts.gpus_per_worker} but no worker of the cluster at "
                                   f"{opts.scheduler_address} offers a GPU resource (waited {worker_wait_s():g} s, "
                                   f"{WORKER_WAIT_ENV}): start the workers with `dask worker ... --resources GPU=1`")
                client.register_plugin(PreemptionPlugin(restart=cluster is not None), name=PreemptionPlugin.name)
                if cluster is None:  # `dask worker` nannies: a SIGTERM to the CLI must not kill a shard mid-commit
                    client.register_plugin(DrainNannyPlugin(), name=DrainNannyPlugin.name)
                plugin_name = register_engine(client, EnginePlugin(
                    model, engine_config, default_torch_threads(opts.workers) if cluster else None,
                    pinned_fingerprint=run.model_pin.fingerprint if run.model_pin else None))
                client.subscribe_topic(PROGRESS_TOPIC, run.progress.event)
                try:
                    _gather(client, todo, run, plugin_name, resources,
                            keeper=WorkerKeeper(cluster, opts.workers) if cluster is not None else None)
                finally:
                    client.unsubscribe_topic(PROGRESS_TOPIC)
        finally:
            if cluster is not None:
                cluster.close()


# What a shard task raises when the shard (or the worker it ran on) failed, not tokenmill: the engine failed to load or
# was unloaded (RuntimeError, which ShardError and InputChanged are too), OUTPUT's store failed after its retries or the
# worker's connection closed (OSError: ConnectionError, StoreUnreachable, distributed's CommClosedError), the worker
# died more than ALLOWED_FAILURES times (KilledWorker), the model or input is the problem (InputError: ModelPinError).
# Each fails its shard and the job goes on. Anything else (TypeError, KeyError, ...) is a bug: it fails the run, with
# its traceback, instead of reading as a failed shard.
SHARD_FAILURES: tuple[type[BaseException], ...] = (RuntimeError, OSError, KilledWorker, InputError)


def _gather(client: Client, todo: list[Shard], run: RunContext, plugin_name: str, resources: dict[str, float] | None, *,
            keeper: WorkerKeeper | None) -> None:
    """Submit the shards and fold their outcomes into run.summary, resubmitting interrupted ones. A worker that
    reports WorkerPreempted is restarted (our LocalCluster, kept at its worker count by `keeper`: its process is all
    there is) or retired (a real cluster, keeper None: the machine is going away) before its shard is submitted
    again. Raises JobError (exit 1) when the keeper gives up replacing lost workers (the shards left are stopped)."""
    output_url, summary, progress, lease = run.output_url, run.summary, run.progress, run.lease
    run_id = progress.run_id
    futures: dict[Future, tuple[Shard, int]] = {}

    def submit(shard: Shard, tries: int) -> Future:
        fut = client.submit(shard_task, shard, run.prompt_column, output_url, run.cfg, plugin_name, run_id,
                            run.pinned.get(shard.url), run.model_pin, pure=False, resources=resources,
                            key=f"shard-{shard.shard_id}-{run_id}-{tries}")
        futures[fut] = (shard, tries)
        return fut

    done_watching = threading.Event()

    def watch() -> None:
        # A lost lease: stop waiting for shards (their commits stay valid; the new holder skips what they commit).
        # Our LocalCluster's lost workers are replaced; once the keeper gives up, stop waiting too.
        while not done_watching.wait(1.0):
            if lease.lost.is_set() or (keeper is not None and keeper.check() is not None):
                client.cancel(list(futures))
                return

    watcher = threading.Thread(target=watch, name="tokenmill-run-watch", daemon=True)
    watcher.start()
    # NOTE: without loop=, as_completed waits on the *default* client's loop (maybe a closed one): it never woke.
    pending = as_completed([submit(s, 0) for s in todo], loop=client.loop)
    cancelled_queue = False
    try:
        for fut in pending:
            shard, tries = futures.pop(fut)
            if fut.status == "cancelled":
                summary.stopped[shard.shard_id] = "not finished: the run stopped waiting for it"
                continue
            try:
                row = fut.result()
                if isinstance(row, ShardStopped):
                    raise row.error
            except (ShardInterrupted, WorkerPreempted) as e:  # a cancel comes as ShardStopped, a preemption raised
                summary.interruptions += 1
                if isinstance(e, WorkerPreempted) and e.reason != NANNY_CLOSING:  # a closing nanny does it itself
                    _take_out(client, e.worker, restart=keeper is not None)
                if cancel_record(output_url) is not None:
                    summary.cancelled = True
                    summary.stopped[shard.shard_id] = f"cancelled: {e}"
                    if not cancelled_queue:  # drop the shards that have not started
                        cancelled_queue = True
                        running = {k for keys in client.processing().values() for k in keys}
                        client.cancel([f for f in futures if f.key not in running])
                elif tries + 1 < MAX_INTERRUPTIONS and not lease.lost.is_set():
                    log.info("shard %s interrupted (%s); running it again", shard.shard_id, e)
                    pending.add(submit(shard, tries + 1))
                else:
                    fail_shard(run, shard.shard_id, f"ShardInterrupted {tries + 1} times; last: {e}")
                continue
            except SHARD_FAILURES as e:  # one failed shard never fails the others
                log.warning("shard %s failed: %s: %s", shard.shard_id, type(e).__name__, e)
                row = ShardFailed(f"{type(e).__name__}: {e}")
            if isinstance(row, ShardFailed) and row.no_space:
                # Not the shard's fault and not a preemption: every other shard would fail the same way. Stop here;
                # the rerun after freeing space resumes from what is committed.
                client.cancel(list(futures))
                left = {s.shard_id: s.num_rows for s in todo}
                raise JobError(no_space_line(row.error, run.output_url, left), exit_code=EXIT_NO_SPACE)
            if isinstance(row, ShardFailed):
                fail_shard(run, shard.shard_id, row.error)
                progress.finish(shard.shard_id, shard.num_rows, 0)
                continue
            summary.add(row)
            progress.finish(shard.shard_id, int(row["rows"]), generated_tokens(row))
    finally:
        done_watching.set()
        watcher.join()
    if keeper is not None and keeper.gave_up is not None:
        raise JobError(keeper.gave_up, exit_code=EXIT_FAILED_SHARDS)


def fail_shard(run: RunContext, shard_id: str, error: str) -> None:
    """Record the shard as failed in the run's summary, with what its attempts cost (they ran: their device-seconds
    are billed) and the rows its checkpoints keep for the rerun, said after `error`."""
    try:
        record = ShardRecord.read(run.output_url, shard_id)
        device_s, cost = record.unfinished_bill(run.cfg.checkpoint_seconds, run.cfg.price_per_hour_usd)
        kept = len(record.committed_rows())
    except (OSError, ValueError) as e:  # the store may be what failed: the error is the line to give
        log.info("could not bill the attempts of shard %s: %s: %s", shard_id, type(e).__name__, e)
        run.summary.fail(shard_id, error, attempts_claimed(run.output_url, shard_id))
        return
    if kept:
        error += f" ({kept} rows are checkpointed: the same command, run again once this is fixed, takes them)"
    run.summary.fail(shard_id, error, record.attempts.latest, device_s, cost)


def attempts_claimed(output_url: str, shard_id: str) -> int:
    """Attempts the shard has claimed in all (its attempt records), for a failed shard's summary; 0 when they cannot
    be listed (the failure may be the store's)."""
    try:
        return ShardRecord.open(output_url, shard_id).attempts.latest
    except (OSError, ValueError) as e:  # the store, or an attempt record it cannot parse: not worth a second failure
        log.info("could not list the attempts of shard %s: %s: %s", shard_id, type(e).__name__, e)
        return 0


def _take_out(client: Client, worker: str, restart: bool) -> None:
    """Restart or retire a preempted worker; errors are logged (the worker takes itself out after a grace)."""
    try:
        if restart:
            client.restart_workers([worker], raise_for_error=False)
        else:
            client.retire_workers([worker], close_workers=True)
    except Exception as e:  # noqa: BLE001 best effort: the worker may be gone already, and takes itself out anyway
        log.info("could not take preempted worker %s out: %s: %s", worker, type(e).__name__, e)
