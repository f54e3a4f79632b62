"""Jobs that survive their machines: a SIGKILLed worker, a SIGTERMed (spot-preempted) worker, a crashed run, a
cancel. Real GSM8K rows, the tiny random-weight model (tests/jobs/conftest.py), one LocalCluster of two worker
processes for the module, reached by its scheduler address as a real cluster would be (engines stay resident across
the jobs).

The kill, the SIGTERM and the cancel must land while a shard still has rows to run: the workers load
hold_shard_preload.py, and the first worker to finish two rows of a shard holds its engine until the shard is told
to stop (held_shard.py), so they land mid-shard however fast or loaded the machine is."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import dask
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from distributed import Client, LocalCluster
from gsm8k_rows import write_gsm8k
from held_shard import PRELOAD, WAIT_S, armed, held_attempts
from typer.testing import CliRunner

import jobs.preemption_plugin
from engine import EngineConfig, LLMEngine
from jobs.cli import app
from jobs.cluster import CLUSTER_CONFIG
from jobs.control import cancel_job, job_status
from jobs.lease import Lease
from jobs.runner import run_job
from pipeline.attempts import claim_attempt, list_attempts, read_record
from pipeline.checkpoint import committed_parts
from pipeline.config import RunConfig
from pipeline.layout import end_path, start_path
from pipeline.manifest import pin_manifest
from pipeline.shard import ShardInterrupted, run_shard
from pipeline.storage import output_fs

ENGINE = EngineConfig(device="cpu", dtype="float32", max_num_seqs=2, kv_cache_memory_bytes=256 << 20)


@contextlib.contextmanager
def two_workers() -> Iterator[tuple[LocalCluster, Client]]:
    """Two single-threaded worker processes under nannies (a killed worker is restarted) with run_job's settings
    (CLUSTER_CONFIG: shards outlive dead workers; no worker profiler), hold_shard_preload.py loaded (armed by
    held_shard.armed); cancel markers polled every 0.2 s."""
    with pytest.MonkeyPatch.context() as mp, dask.config.set(CLUSTER_CONFIG):
        mp.setenv("TOKENMILL_STOP_POLL_S", "0.2")
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                          silence_logs=logging.ERROR, preload=[str(PRELOAD)]) as cluster, Client(cluster) as client:
            yield cluster, client


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[LocalCluster, Client]]:
    """The module's two_workers cluster, shared by its tests; the SIGTERM test, which leaves it one worker, runs
    last. Its close: the SIGTERMed worker has left and no longer listens, and its nanny's drain (run_job registers
    DrainNannyPlugin on a cluster it reaches by address) would try to reach it for DRAIN_CONNECT_S (5 s, idle);
    here it tries for 0.5 s (every connect of the close is on 127.0.0.1, and no shard is left to drain)."""
    with pytest.MonkeyPatch.context() as mp, two_workers() as pair:
        yield pair
        mp.setattr(jobs.preemption_plugin, "DRAIN_CONNECT_S", 0.5)  # for the close only, undone after it


def _results(out: Path) -> dict[str, str]:
    rows = pq.read_table(out / "results").to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id appears twice"
    return {r["id"]: r["completion"] for r in rows}


def _accounting(out: Path) -> dict[str, dict]:
    return {r["shard_id"]: r for r in pq.read_table(out / "accounting").to_pylist()}


def _when_held(out: Path, claim: Path, act: Callable[[str, int, int], None]) -> threading.Thread:
    """Start a thread that waits until a worker holds a shard that committed a part (held_shard.held_attempts),
    then calls act(shard id, attempt, worker pid) once. `thread.acted` holds the shard id (None if it never
    happened); set `thread.job_ended` once the job returned (a job that ended without a hold ends the wait)."""
    def watch() -> None:
        pid, held = held_attempts(out, claim, running=lambda: not thread.job_ended.is_set())  # type: ignore[attr-defined]
        act(*held[0], pid)
        thread.acted = held[0][0]  # type: ignore[attr-defined]

    thread = threading.Thread(target=watch, daemon=True)
    thread.acted, thread.job_ended = None, threading.Event()  # type: ignore[attr-defined]
    thread.start()
    return thread


def test_sigkill_of_a_worker_mid_shard(cluster: tuple[LocalCluster, Client], data_dir: Path,
                                       tmp_path: Path) -> None:
    """The worker running a shard is SIGKILLed once the shard, held after its first rows, has left a sign of life
    (a heartbeat) after its last checkpoint: the shard runs again on a worker, resumes from the checkpoint, and its
    results equal an undisturbed run's (a job of that shard's rows, run afterwards: the other shard was never
    disturbed). The killed attempt is billed the device-seconds its last sign of life says it held, never past the kill.
    Before: the time from its last checkpoint to the next attempt's start (worker restart included), capped at
    --checkpoint-seconds, whatever it ran."""
    _, client = cluster
    ids = write_gsm8k(data_dir, tmp_path / "in", 400, 24)
    cfg = RunConfig(prompt_column="question", max_tokens=16, rows_per_shard=12, checkpoint_rows=2,
                    heartbeat_seconds=0.2)
    addr = client.scheduler.address
    out = tmp_path / "out"
    fs, root = output_fs(str(out))
    killed_at: list[float] = []

    def kill(shard: str, attempt: int, pid: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # the held attempt's heartbeat after its last part, then the kill
            kept = max(read_record(fs, p.marker)["elapsed_s"] for p in committed_parts(fs, root, shard)
                       if p.attempt == attempt)
            if list_attempts(fs, root, shard).alive.get(attempt, 0.0) > kept:
                break
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        killed_at.append(time.time())

    with armed(client, tmp_path / "hold-claim"):
        killer = _when_held(out, tmp_path / "hold-claim", kill)
        summary = run_job(str(tmp_path / "in"), str(out), cfg, engine_config=ENGINE, scheduler_address=addr)
        killer.job_ended.set()
        killer.join()
    killed = killer.acted
    assert killed is not None, "no shard was caught mid-run"
    assert summary.shards_ok == 2 and not summary.failed and (out / "_SUCCESS").is_file()

    results = _results(out)
    assert sorted(results) == sorted(ids)  # every id exactly once
    # The killed shard's rows as a job of their own, undisturbed: one shard of the same rows in the same order.
    table = pq.read_table(tmp_path / "in" / "in.parquet")
    killed_ids = pq.read_table(out / "results" / f"{killed}.parquet").column("id")
    (tmp_path / "ref-in").mkdir()
    pq.write_table(table.filter(pc.is_in(table.column("id"), value_set=killed_ids)), tmp_path / "ref-in" / "in.parquet")
    ref = run_job(str(tmp_path / "ref-in"), str(tmp_path / "ref"), cfg, engine_config=ENGINE, scheduler_address=addr)
    assert ref.shards_ok == 1 and not ref.failed
    ref_results = _results(tmp_path / "ref")
    assert len(ref_results) == 12  # greedy: the same completions as without the kill
    assert {i: results[i] for i in ref_results} == ref_results
    acct = _accounting(out)[killed]
    assert acct["attempts"] >= 2 and acct["preemptions"] >= 1 and acct["rows_resumed"] >= 2
    assert summary.attempts >= 3 and summary.preemptions >= 1

    # The bill of the killed attempt, from its own records.
    listing = list_attempts(fs, root, killed)
    earlier = [a for a in listing.started if a < acct["attempt"]]
    assert len(earlier) == 1 and earlier[0] not in listing.ended  # the killed one: no end record
    dead = earlier[0]
    started_at = read_record(fs, start_path(root, killed, dead))["started_at"]
    marker = read_record(fs, [p for p in committed_parts(fs, root, killed) if p.attempt == dead][-1].marker)
    assert dead in listing.alive and dead in listing.alive_device_s  # signs of life after its last checkpoint
    # Billed the device-seconds its last sign says it held (its share of the worker's engine: issue 51 item 2).
    last_sign = max(marker["device_s"], listing.alive_device_s[dead])
    assert acct["device_s_billed"] - acct["device_s"] == pytest.approx(last_sign, abs=1e-6)
    assert acct["device_s_lost"] == pytest.approx(last_sign - marker["device_s"], abs=1e-6)
    assert last_sign <= max(marker["elapsed_s"], listing.alive[dead]) + 1e-3  # a share: never above its wall time
    assert max(marker["elapsed_s"], listing.alive[dead]) <= killed_at[0] - started_at + 0.5  # nothing after the kill


def test_restart_after_a_crash_runs_only_what_is_missing(cluster: tuple[LocalCluster, Client], engine: LLMEngine,
                                                         data_dir: Path, tmp_path: Path) -> None:
    """A run crashed with shard 0 committed, shard 1 checkpointed halfway, shard 2 claimed and nothing more, and its
    lease unexpired when it died. The rerun waits out nothing it need not, leaves shard 0 alone, resumes shard 1,
    and runs shard 2."""
    _, client = cluster
    ids = write_gsm8k(data_dir, tmp_path / "in", 600, 24)
    cfg = RunConfig(prompt_column="question", max_tokens=16, rows_per_shard=8, checkpoint_rows=2)
    out = tmp_path / "out"
    manifest, _ = pin_manifest(str(out), str(tmp_path / "in"), cfg)
    s0, s1, s2 = manifest.shards()
    Lease(str(out), ttl_s=0.5, holder="crashed-host:1:dead").acquire()  # the dead run's lease, never renewed
    small = engine.with_config(ENGINE)
    run_shard(small, s0, "question", str(out), cfg)
    parts = out / "checkpoints" / s1.shard_id
    with pytest.raises(ShardInterrupted):
        run_shard(small, s1, "question", str(out), cfg, should_stop=lambda: any(parts.glob("*.commit")))
    Path(end_path(str(out), s1.shard_id, 1)).unlink()  # a SIGKILL leaves no end record
    fs, root = output_fs(str(out))
    claim_attempt(fs, root, s2.shard_id)  # started, then the machine vanished
    before = {p: p.stat().st_mtime_ns for p in [out / "results" / f"{s0.shard_id}.parquet",
                                                 *out.glob(f"accounting/{s0.shard_id}.*")]}
    assert job_status(str(out)).shards == {"done": 1, "running": 2, "partial": 0, "failed": 0, "pending": 0}

    time.sleep(0.6)  # the crashed run's lease expires
    summary = run_job(str(tmp_path / "in"), str(out), cfg, engine_config=ENGINE,
                      scheduler_address=client.scheduler.address)
    assert summary.shards_ok == 3 and not summary.failed and (out / "_SUCCESS").is_file()
    assert {p: p.stat().st_mtime_ns for p in before} == before  # shard 0 untouched
    assert sorted(_results(out)) == sorted(ids)
    acct = _accounting(out)
    assert acct[s0.shard_id]["attempts"] == 1
    assert acct[s1.shard_id]["attempts"] == 2 and acct[s1.shard_id]["rows_resumed"] >= 2
    assert acct[s1.shard_id]["preemptions"] == 1
    assert acct[s2.shard_id]["attempts"] == 2 and acct[s2.shard_id]["rows_resumed"] == 0
    st = job_status(str(out))
    assert st.state == "done" and st.exit_code == 0 and st.attempts == 5 and st.rows_committed == 24


def test_cancel_stops_running_shards_and_resume_finishes(cluster: tuple[LocalCluster, Client], data_dir: Path,
                                                         tmp_path: Path) -> None:
    _, client = cluster
    ids = write_gsm8k(data_dir, tmp_path / "in", 700, 24)
    out = tmp_path / "out"
    args = ["run", str(tmp_path / "in"), str(out), "--prompt-column", "question", "--max-tokens", "16",
            "--rows-per-shard", "8", "--checkpoint-rows", "2", "--max-num-seqs", "2", "--kv-cache-gib", "0.25",
            "--device", "cpu", "--scheduler", client.scheduler.address, "--json"]
    runner = CliRunner()
    with armed(client, tmp_path / "hold-claim"):
        canceller = _when_held(out, tmp_path / "hold-claim", lambda _s, _a, _p: cancel_job(str(out), "test"))
        res = runner.invoke(app, args)
        canceller.job_ended.set()
        canceller.join()
    assert canceller.acted is not None
    assert res.exit_code == 4, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["cancelled"] and summary["shards_stopped"] >= 1 and summary["shards_ok"] < 3
    assert not (out / "_SUCCESS").exists()

    status = runner.invoke(app, ["status", str(out), "--json"])
    assert status.exit_code == 4
    st = json.loads(status.stdout)
    assert st["state"] == "cancelled" and st["cancelled"]["reason"] == "test"
    assert st["shards"]["partial"] >= 1 and st["shards"]["done"] < 3 and 0 < st["rows_committed"] < 24

    refused = runner.invoke(app, args)
    assert refused.exit_code == 4 and "--resume" in refused.stderr
    resumed = runner.invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert sorted(_results(out)) == sorted(ids)
    assert not (out / "_CANCEL").exists() and (out / "_manifest" / "cancel-000.json").is_file()
    assert sum(a["rows_resumed"] for a in _accounting(out).values()) >= 2
    assert json.loads(runner.invoke(app, ["status", str(out), "--json"]).stdout)["state"] == "done"


def test_sigterm_interrupts_the_shard_which_resumes_elsewhere(cluster: tuple[LocalCluster, Client], data_dir: Path,
                                                              tmp_path: Path) -> None:
    """A spot notice as SIGTERM: the shard commits its finished rows and stops (ShardInterrupted), the worker closes
    gracefully, the client runs the shard again on the other worker, and it resumes. The module's last test: the
    SIGTERMed worker retires with its nanny, and scaling the cluster back up for a later test was seen to hang."""
    ids = write_gsm8k(data_dir, tmp_path / "in", 500, 24)
    cfg = RunConfig(prompt_column="question", max_tokens=16, rows_per_shard=12, checkpoint_rows=2)
    out = tmp_path / "out"
    _, client = cluster
    with armed(client, tmp_path / "hold-claim"):
        terminator = _when_held(out, tmp_path / "hold-claim", lambda _s, _a, pid: os.kill(pid, signal.SIGTERM))
        summary = run_job(str(tmp_path / "in"), str(out), cfg, engine_config=ENGINE,
                          scheduler_address=client.scheduler.address)
        terminator.job_ended.set()
        terminator.join()
    stopped = terminator.acted
    assert stopped is not None, "no shard was caught mid-run"
    assert summary.shards_ok == 2 and not summary.failed and summary.interruptions >= 1
    assert sorted(_results(out)) == sorted(ids)
    end = json.loads(Path(end_path(str(out), stopped, 1)).read_text())
    assert end["outcome"] == "interrupted" and end["rows_committed"] >= 2
    acct = _accounting(out)[stopped]
    assert acct["attempts"] >= 2 and acct["preemptions"] >= 1 and acct["rows_resumed"] >= 2
