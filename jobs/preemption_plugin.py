"""Worker plugins for stopping: a worker's stop notices (SIGTERM, spot notices) become the StopSignal every shard
on its resident engine polls (PreemptionPlugin), and a closing nanny gives those shards their stop deadline
(DrainNannyPlugin). One signal stops every shard in the engine through the same drain path: each commits its
finished rows in its own thread and fails with WorkerPreempted."""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
from typing import Any

from distributed import NannyPlugin, WorkerPlugin, get_worker
from distributed.core import Status

log = logging.getLogger(__name__)

PREEMPTION_PLUGIN = "tokenmill-preemption"
# How long a worker whose shard was interrupted waits for the client to retire or restart it before it does so itself
# (the client acts once the shard's error has reached it, so the error is never lost to a worker removal), seconds.
RETIRE_GRACE_S = 30.0


class WorkerPreempted(RuntimeError):
    """A shard stopped because its worker is going away (SIGTERM or a spot notice), after committing its finished
    rows. `worker` is the worker's address, `reason` what stopped it; rows as in pipeline.shard.ShardInterrupted."""

    def __init__(self, rows_committed: int, rows_in_flight: int, worker: str, reason: str | None) -> None:
        super().__init__(rows_committed, rows_in_flight, worker, reason)  # args = the constructor's: picklable
        self.rows_committed, self.rows_in_flight, self.worker, self.reason = (rows_committed, rows_in_flight,
                                                                              worker, reason)

    def __str__(self) -> str:
        return (f"worker {self.worker} stopping ({self.reason}): {self.rows_committed} rows committed, "
                f"{self.rows_in_flight} left for the next attempt")


class QuietPreemption(logging.Filter):
    """Drops the Dask worker's "Compute Failed" record of a task that raised WorkerPreempted: a shard that stopped
    because its worker is going away is an outcome the client handles (it runs the shard again elsewhere), not an
    error a user should read a traceback for. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("Compute Failed") and len(args) > 3
                    and str(args[3]).startswith(f"{WorkerPreempted.__name__}("))


WORKER_LOGGER = "distributed.worker"  # the logger of Dask's "Compute Failed" and heartbeat records


class QuietHeartbeat(logging.Filter):
    """Turns the Dask worker's "Failed to communicate with scheduler during heartbeat." record (logged with a
    traceback at ERROR, which `silence_logs=ERROR` lets through) into a one-line WARNING without the traceback: it is
    the race of a heartbeat in flight while the job's cluster closes (seen on a loaded 2-core machine at the end of a
    cancelled job), or a blip the next heartbeat retries; a scheduler that is really gone closes the worker by its own
    path. No traceback reaches a user. Stays installed for the life of the worker process (the race comes after the
    plugins' teardown)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Failed to communicate with scheduler during heartbeat"):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.WARNING)
        return True


def quiet_heartbeat() -> None:
    """Install QuietHeartbeat on the worker logger of this process, once."""
    logger = logging.getLogger(WORKER_LOGGER)
    if not any(isinstance(f, QuietHeartbeat) for f in logger.filters):
        logger.addFilter(QuietHeartbeat())


class PreemptionPlugin(WorkerPlugin):
    """Turns a worker's stop notices into a StopSignal that its shards poll, and takes the worker out afterwards.

    At `setup` (on the worker process's main thread, where Python allows signal handlers: the nanny's worker
    process runs its event loop there) SIGTERM is pointed at the signal (pipeline.preemption.install_sigterm_handler);
    the signal also watches the spot notice file and URL of the environment (TOKENMILL_SPOT_NOTICE_FILE / _URL).
    A shard it stops commits its finished rows and fails with WorkerPreempted; the client then retires the worker
    (or restarts it, on a LocalCluster that has no other machine to move to) and runs the shard again, resuming
    from its checkpoints. A watcher thread covers the rest: a stopped worker with no shard running is taken out by
    itself, at once when no shard was interrupted, else after RETIRE_GRACE_S if the client has not done it.
    Without the main thread (a threads-only cluster) SIGTERM keeps its old meaning; the notices still work.

    Args:
        restart: when the worker takes itself out, restart its process under the nanny (LocalCluster) instead
            of closing worker and nanny (a real cluster, where the machine is going away).
    """

    idempotent = True
    name = PREEMPTION_PLUGIN

    def __init__(self, restart: bool = False) -> None:
        self.restart = restart

    def setup(self, worker: Any) -> None:
        from pipeline.preemption import StopSignal, install_sigterm_handler

        self.stop = StopSignal.from_env()
        self.running = 0
        self.interrupted = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._previous: Any = None
        self.sigterm_installed = threading.current_thread() is threading.main_thread()
        if self.sigterm_installed:
            self._previous = install_sigterm_handler(self.stop)
        self.closed = threading.Event()
        self.quiet = QuietPreemption()
        logging.getLogger(WORKER_LOGGER).addFilter(self.quiet)
        quiet_heartbeat()
        threading.Thread(target=self._watch, args=(worker,), name="tokenmill-preemption", daemon=True).start()

    def teardown(self, worker: Any) -> None:
        # A worker closing for any reason (its nanny's stop, a retire) stops its shard: the finished rows are committed
        # in the time the close leaves instead of being lost with the process.
        self.stop.set("worker closing")
        self.closed.set()
        logging.getLogger(WORKER_LOGGER).removeFilter(self.quiet)
        if self.sigterm_installed and threading.current_thread() is threading.main_thread():
            import signal

            signal.signal(signal.SIGTERM, self._previous)
        self.stop.close()

    def shard_started(self) -> None:
        """Count a shard in (the worker takes itself out only when none is running)."""
        with self._lock:
            self.running += 1

    def shard_ended(self, interrupted: bool) -> None:
        """Count a shard out; `interrupted`: this worker's stop signal stopped it."""
        with self._lock:
            self.running -= 1
            self.interrupted |= interrupted
            self._idle.notify_all()

    def leave(self, worker: Any) -> None:
        """Take the worker out, from any thread: close it gracefully (the scheduler stops sending it work and
        reschedules what it holds), restarting its process if `restart`. `closed` is set at its plugins' teardown."""
        if not self.closed.is_set():
            worker.loop.add_callback(worker.close_gracefully, restart=self.restart,
                                     reason=f"tokenmill: {self.stop.reason}")

    def _watch(self, worker: Any) -> None:
        while not self.closed.is_set():
            if self.stop.is_set():
                with self._lock:
                    self._idle.wait_for(lambda: self.running == 0)
                    interrupted = self.interrupted
                if not (interrupted and self.closed.wait(RETIRE_GRACE_S)):
                    self.leave(worker)
                return
            self.closed.wait(0.5)


def get_preemption() -> PreemptionPlugin | None:
    """This worker's PreemptionPlugin, or None when it is not registered."""
    plugin = get_worker().plugins.get(PREEMPTION_PLUGIN)
    return plugin if isinstance(plugin, PreemptionPlugin) else None


DRAIN_PLUGIN = "tokenmill-drain"
NANNY_CLOSING = "nanny closing"  # the stop reason of a drain: the nanny takes the worker out itself
# Seconds a nanny's drain waits beyond TOKENMILL_STOP_DEADLINE_S: the engine's current step, the end record, the
# shard's error reaching the scheduler.
DRAIN_MARGIN_S = 10.0
# Seconds the closing nanny tries to reach its worker (all on one host): a worker that stopped itself already (a
# SIGTERM of its own process, PreemptionPlugin) no longer listens, and Dask's default connect timeout (30 s) would
# hold the nanny's close, and the pod's grace period, that long.
DRAIN_CONNECT_S = 5.0


class DrainNannyPlugin(NannyPlugin):
    """Gives a worker's shards their stop deadline when its nanny closes (SIGTERM to the `dask worker` CLI).

    On Kubernetes the kubelet sends SIGTERM to the pod's PID 1, the `dask worker` CLI; the worker process (the
    nanny's child) gets no signal. The CLI closes its nanny with a 10 s timeout, and the nanny tells the worker to
    close and kills it after 0.8 x 10 = 8 s (distributed/cli/dask_worker.py, nanny.py): less than
    TOKENMILL_STOP_DEADLINE_S (default 20 s), and the close reports the worker gone before the shard has committed.
    This plugin's `teardown` runs first in the nanny's close, before the kill and for as long as it needs: it stops
    the worker's shards (PreemptionPlugin's StopSignal, reason NANNY_CLOSING), keeps new tasks off the worker, and
    waits until the running shard has committed its finished rows and failed with WorkerPreempted (so the client
    runs it again elsewhere), at most TOKENMILL_STOP_DEADLINE_S + DRAIN_MARGIN_S seconds. The pod's
    terminationGracePeriodSeconds must cover that plus the preStop hook and the worker's close (infra/README.md).
    Registered by `tokenmill run` on clusters it connects to (not on its own LocalCluster).
    """

    idempotent = True
    name = DRAIN_PLUGIN

    async def teardown(self, nanny: Any) -> None:
        address = nanny.worker_address if nanny.process is not None else None
        if not address:
            return
        from pipeline.preemption import stop_deadline_s

        timeout_s = stop_deadline_s() + DRAIN_MARGIN_S
        try:
            # Connect first under DRAIN_CONNECT_S; the call below takes this connection from the nanny's pool.
            nanny.rpc.reuse(address, await nanny.rpc.connect(address, timeout=DRAIN_CONNECT_S))
            async with nanny.rpc(address) as worker:
                reply = await asyncio.wait_for(
                    worker.run(function=pickle.dumps(drain_worker), args=pickle.dumps((timeout_s,))), timeout_s + 5)
            if reply.get("status") == "OK" and reply["result"]:
                log.warning("worker %s still runs %d shards after %.0f s; closing it", address, reply["result"],
                            timeout_s)
        except Exception as e:  # the worker may be gone already; the nanny's close goes on
            log.info("could not drain worker %s: %s", address, e)


async def drain_worker(timeout_s: float, dask_worker: Any) -> int:
    """Run on a worker's event loop (DrainNannyPlugin): stop its shards, start no new task, and wait up to
    `timeout_s` seconds until no task executes. Returns the tasks still executing (0 when drained)."""
    plugin = dask_worker.plugins.get(PREEMPTION_PLUGIN)
    if isinstance(plugin, PreemptionPlugin):
        plugin.stop.set(NANNY_CLOSING)
    if dask_worker.status == Status.running:
        dask_worker.status = Status.closing_gracefully  # the scheduler sends it nothing more; queued tasks wait
    deadline = time.monotonic() + timeout_s
    while dask_worker.state.executing_count and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return dask_worker.state.executing_count
