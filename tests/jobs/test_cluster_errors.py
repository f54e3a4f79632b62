"""What a shard task raises (issue 31): a shard's own failure (the engine failed to load, the store, a dead worker)
fails that shard and the run goes on; a bug of ours (TypeError, KeyError, ...) fails the run with its traceback
instead of reading as a failed shard. The shards of real GSM8K rows go through jobs.cluster's gathering on an
in-process Dask cluster whose task is replaced by one that raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from distributed import Client, LocalCluster
from gsm8k_rows import write_gsm8k
from hang_guard import hang_guard

import jobs.cluster
from jobs.cluster import RunContext, _gather
from jobs.lease import Lease
from jobs.summary import JobProgress, JobSummary
from pipeline.config import RunConfig
from pipeline.manifest import pin_manifest


@pytest.fixture(scope="module")
def client() -> Any:
    """An in-process Dask cluster (threads: a replaced task reaches its workers)."""
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as c:
        yield c


HANG_GUARD_S = 120  # a hang guard only: each gather here ends in about a second


def _stuck(client: Client) -> str:
    """What the scheduler and the client know of the run's tasks (in-process: read directly, the event loop may be
    what is stuck)."""
    states = {key: ts.state for key, ts in list(client.cluster.scheduler.tasks.items())}
    return f"_gather; the scheduler's tasks: {states}; the client's futures: {dict(client.futures)}"


def _gather_raising(error: BaseException, client: Client, data_dir: Path, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> JobSummary:
    """Two shards of 4 real rows gathered with a shard task that raises `error` (a run id of its own: Dask keys name
    the run); returns the run's summary."""
    write_gsm8k(data_dir, tmp_path / "in", 600, 8)
    out = str(tmp_path / "out")
    cfg = RunConfig(prompt_column="question", max_tokens=4, rows_per_shard=4)
    manifest, _ = pin_manifest(out, str(tmp_path / "in"), cfg)

    def shard_task(*_args: Any, **_kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(jobs.cluster, "shard_task", shard_task)
    summary = JobSummary()
    with Lease(out) as lease:
        run = RunContext(out, cfg, manifest.prompt_column, {f.url: f for f in manifest.files}, summary,
                         JobProgress(f"errors-{tmp_path.name}", None), lease)
        with hang_guard(HANG_GUARD_S, lambda: _stuck(client)):
            _gather(client, manifest.shards(), run, "unused", None, keeper=None)
    return summary


@pytest.mark.parametrize("error", [RuntimeError("the engine failed to load on this worker: no such file"),
                                   ConnectionError("cannot reach the object store")])
def test_a_shards_own_failure_fails_that_shard_and_the_run_goes_on(
        error: BaseException, client: Client, data_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    summary = _gather_raising(error, client, data_dir, tmp_path, monkeypatch)
    assert len(summary.failed) == 2 and summary.shards_ok == 0
    assert all(e == f"{type(error).__name__}: {error}" for e in summary.failed.values())


def test_a_bug_in_the_task_fails_the_run_not_a_shard(
        client: Client, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="a bug"):
        _gather_raising(TypeError("a bug"), client, data_dir, tmp_path, monkeypatch)


def test_the_wait_is_on_the_submitting_clients_loop_whatever_the_default_client(
        client: Client, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process whose default client is another one (here a closed client made current, whose loop no longer runs:
    as_completed without a loop tracks the futures there, and waited forever) still gathers on its own client."""
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as other_cluster:
        other = Client(other_cluster, set_as_default=False)
        other.close()
    with other.as_current():
        summary = _gather_raising(RuntimeError("the engine failed to load"), client, data_dir, tmp_path, monkeypatch)
    assert len(summary.failed) == 2 and summary.shards_ok == 0
