"""A run's own LocalCluster keeps its worker count (jobs.local_workers, issue 41 item 7): a worker whose nanny is
closed for good is replaced, so the shards left of a one-worker run never wait forever for a worker.

The loss is made deterministic: `distributed.deploy.lost-worker-timeout` 0 s makes SpecCluster close the nanny of a
worker the scheduler lost before that nanny's restarted worker can register again (a slow restart on a loaded
machine, as seen once in test_shard_slots). The shard task is replaced by one whose first run kills its own worker
process (SIGKILL: the nanny restarts it) or raises WorkerPreempted (the client restarts the worker:
jobs.cluster._take_out); every later run returns its shard's accounting row. Real GSM8K rows; no model is loaded.
Before the keeper, both runs below waited for a worker forever; the hang guard fails them instead."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dask
import pytest
from distributed import get_worker
from distributed.core import Status
from gsm8k_rows import write_gsm8k
from hang_guard import hang_guard

import jobs.cluster
from engine import EngineConfig
from jobs.cluster import ClusterOptions, RunContext, run_on_cluster
from jobs.lease import Lease
from jobs.local_workers import WorkerKeeper
from jobs.plugin import WorkerPreempted
from jobs.summary import JobProgress, JobSummary
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.manifest import pin_manifest

HANG_GUARD_S = 180  # a hang guard only: the run ends in seconds once a worker is back


def _task(marker: str, how: str) -> Any:
    """A shard task whose first run (of all, claimed by an O_EXCL create of `marker`) loses its worker `how`."""
    def shard_task(shard: Shard, *_args: Any, **_kwargs: Any) -> dict[str, Any]:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return {"shard_id": shard.shard_id, "rows": shard.num_rows, "rows_ok": shard.num_rows, "rows_error": 0,
                    "wall_s": 0.0, "input_tokens": 0, "output_tokens": 0, "generated_tokens": 0, "cost_usd": 0.0}
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        raise WorkerPreempted(0, shard.num_rows, get_worker().address, "SIGTERM")

    return shard_task


@pytest.mark.parametrize("how", ["killed", "preempted"])
def test_a_one_worker_run_replaces_a_worker_lost_for_good(how: str, data_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write_gsm8k(data_dir, tmp_path / "in", 700, 4)
    out = str(tmp_path / "out")
    cfg = RunConfig(prompt_column="question", max_tokens=4, rows_per_shard=2)
    manifest, _ = pin_manifest(out, str(tmp_path / "in"), cfg)
    monkeypatch.setattr(jobs.cluster, "shard_task", _task(str(tmp_path / "first-run"), how))
    keepers: list[WorkerKeeper] = []

    def keeper(*args: Any, **kwargs: Any) -> WorkerKeeper:
        keepers.append(WorkerKeeper(*args, **kwargs))
        return keepers[-1]

    monkeypatch.setattr(jobs.cluster, "WorkerKeeper", keeper)
    summary = JobSummary()
    with Lease(out) as lease, dask.config.set({"distributed.deploy.lost-worker-timeout": "0s"}), \
            hang_guard(HANG_GUARD_S, lambda: "the run lost its only worker for good"):
        run = RunContext(out, cfg, manifest.prompt_column, {f.url: f for f in manifest.files}, summary,
                         JobProgress(f"lost-{how}", None), lease)
        run_on_cluster(manifest.shards(), run, None, EngineConfig(device="cpu"),
                       ClusterOptions(workers=1, shard_slots=1))
    assert summary.shards_ok == 2 and not summary.failed and not summary.stopped
    assert keepers[0].lost == 1  # the nanny was closed for good, and its replacement ran the shards


def _nanny(status: Status = Status.running) -> SimpleNamespace:
    return SimpleNamespace(status=status)


def test_the_keeper_counts_each_lost_nanny_once_and_gives_up_past_its_limit() -> None:
    """WorkerKeeper.check on a stand-in cluster: a nanny dropped from the cluster or closed counts once, a
    replacement that failed to start counts too, and past max_lost the line to fail the run with comes back."""
    calls: list[str] = []
    first, second = _nanny(), _nanny()
    cluster = SimpleNamespace(workers={"0": first, "1": second}, scale=lambda n: calls.append(f"scale {n}"),
                              loop=SimpleNamespace(add_callback=lambda f: f()))
    keeper = WorkerKeeper(cluster, 2, max_lost=3)  # type: ignore[arg-type]
    assert keeper.check() is None and not calls  # nothing lost
    del cluster.workers["1"]  # SpecCluster dropped it (lost-worker-timeout)
    assert keeper.check() is None and keeper.lost == 1 and calls == ["scale 2"]
    cluster.workers["1"] = _nanny(Status.failed)  # its replacement failed to start
    first.status = Status.closed  # and the other nanny closed
    assert keeper.check() is None and keeper.lost == 3 and calls == ["scale 2"] * 2
    assert cluster.workers == {}  # both dropped, for scale to open them again
    assert keeper.check() is None and keeper.lost == 3  # nothing new
    cluster.workers["0"] = _nanny(Status.failed)
    line = keeper.check()
    assert line is not None and "lost 4 worker processes for good" in line and "run again resumes" in line
    assert keeper.check() == line and len(calls) == 2  # given up: no more replacements
