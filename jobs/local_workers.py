"""Keep a run's own LocalCluster at its worker count: a worker process whose nanny closed for good is replaced.

A LocalCluster's nanny restarts its worker process when the process dies or is restarted (a preempted worker:
jobs.cluster._take_out, PreemptionPlugin.leave), but some paths close the nanny itself, and then nothing starts a
worker in its place (distributed 2026.8):
  - SpecCluster closes the nanny of a worker absent from the scheduler for `distributed.deploy.lost-worker-timeout`
    (15 s): a restart that takes longer (a loaded machine, a slow preload) loses the worker for good;
  - a worker told "missing" by the scheduler's heartbeat reply, or sent "close" by its remove_worker (a restart that
    timed out), closes with nanny=True;
  - a nanny whose worker process fails to start closes.
With one worker, the job's remaining shards would then wait for a worker forever. WorkerKeeper, polled by the run's
watcher thread, starts a new nanny in place of each closed one (SpecCluster.scale, which opens the worker specs that
have no nanny); after MAX_LOST_WORKERS such losses it gives up with one line, and the run stops waiting.
"""

from __future__ import annotations

from distributed import LocalCluster
from distributed.core import Status

# Nannies of our LocalCluster lost for good (closed, not restarting a worker) that a run replaces before it gives up:
# more means the worker processes cannot run here (each loss is logged by Dask above the line).
MAX_LOST_WORKERS = 10
_DEAD = (Status.closed, Status.failed)


class WorkerKeeper:
    """Keeps `cluster` at `workers` worker processes for one run (module docstring). Call `check` from one thread
    (the run's watcher), about once a second.

    Args:
        cluster: the run's own LocalCluster (started with `workers` workers).
        workers: the worker processes it must keep.
        max_lost: nannies lost for good that are replaced before `check` gives up.
    """

    def __init__(self, cluster: LocalCluster, workers: int, max_lost: int = MAX_LOST_WORKERS) -> None:
        self.cluster, self.workers, self.max_lost = cluster, workers, max_lost
        self.lost = 0
        self.gave_up: str | None = None
        self._alive = list(cluster.workers.values())  # nannies alive at the last check (held: compared by identity)
        self._counted: list[object] = []  # dead nannies still in cluster.workers, already counted

    def check(self) -> str | None:
        """Replace the nannies lost since the last call (closed, or dropped by SpecCluster); return the line to fail
        the run with once more than `max_lost` were lost (and from then on), else None."""
        if self.gave_up is not None:
            return self.gave_up
        now = list(self.cluster.workers.values())  # one C-level copy: the cluster's loop thread mutates the dict
        alive = [w for w in now if w.status not in _DEAD]
        dead = [w for w in now if w.status in _DEAD]
        # Lost: alive before and now dropped, or dead now and not counted yet (a replacement that failed to start).
        lost = ([w for w in self._alive if not any(w is a for a in alive) and not any(w is d for d in dead)]
                + [w for w in dead if not any(w is c for c in self._counted)])
        self._alive, self._counted = alive, dead
        if not lost:
            return None
        self.lost += len(lost)
        if self.lost > self.max_lost:
            self.gave_up = (f"the job's LocalCluster lost {self.lost} worker processes for good (their nannies "
                            f"closed; the errors above say why) and stopped replacing them; what is committed stays, "
                            f"and the same command run again resumes")
            return self.gave_up
        self.cluster.loop.add_callback(self._replace)
        return None

    def _replace(self) -> None:
        # On the cluster's loop: drop the closed nannies (SpecCluster drops those of lost workers itself, after
        # lost-worker-timeout) so that scale() opens their specs again.
        for name, nanny in list(self.cluster.workers.items()):
            if nanny.status in _DEAD:
                del self.cluster.workers[name]
        self.cluster.scale(self.workers)
