"""A spot preemption as Kubernetes delivers it: SIGTERM to the pod's PID 1, the `dask worker` CLI, not to the worker
process. The CLI closes its nanny with timeout=10 and the nanny kills the worker process 0.8 x 10 = 8 s later
(distributed/cli/dask_worker.py, nanny.py), shorter than TOKENMILL_STOP_DEADLINE_S (20 s). jobs.plugin.DrainNannyPlugin
makes the nanny stop the shard and wait for its commit first.

Real `dask scheduler` and `dask worker --nthreads 1 --resources GPU=1` processes with the Dask config Kubernetes
mounts (infra/k8s/base/dask.yaml), `tokenmill run` as a process, real GSM8K rows, the real model on CPU, OUTPUT on a
local S3 (moto) whose first write after the signal takes 10 s: a commit slower than the nanny's 8 s.

The test makes its own timing: the workers load hold_shard_preload.py, which holds the first engine to finish two rows
until its shards are told to stop, so the signal always lands mid-shard, on any machine, under any load.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import psutil
import pyarrow.parquet as pq
from distributed import Client

from jobs.cluster_workers import wait_for_gpu_worker

ROOT = Path(__file__).resolve().parents[2]
DASK = Path(sys.executable).with_name("dask")
DASK_CONFIG = ROOT / "infra" / "k8s" / "base" / "dask.yaml"
WAIT_S = 600.0  # generous: a loaded CI box; the test never asserts on time
HOLD_PRELOAD = Path(__file__).with_name("hold_shard_preload.py")
SLOW_COMMIT_S = 10.0  # the first write of the interrupted attempt after the signal: longer than the nanny's 8 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def dask_cli_cluster(env: dict[str, str], log: Path, workers: int = 2, cwd: Path | None = None,
                     worker_args: tuple[str, ...] = ()) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """`dask scheduler` and `workers` x `dask worker ADDRESS --nthreads 1 --resources GPU=1` processes on 127.0.0.1,
    as the Kubernetes manifests start them (plus `worker_args`), in the working directory `cwd` (default: this one);
    yields the scheduler address and the worker CLI processes once they are all connected. Their output goes to
    `log`."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    out = log.open("ab")
    procs = [subprocess.Popen([str(DASK), "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                               "--dashboard-address", ":0"], env=env, stdout=out, stderr=out, cwd=cwd)]
    try:
        procs += [subprocess.Popen([str(DASK), "worker", address, "--nthreads", "1", "--resources", "GPU=1",
                                    "--name", f"gpu-{i}", "--host", "127.0.0.1", "--dashboard-address", ":0",
                                    *worker_args],
                                   env=env, stdout=out, stderr=out, cwd=cwd) for i in range(workers)]
        with Client(address, timeout=WAIT_S) as client:
            if workers:
                client.wait_for_workers(workers, timeout=WAIT_S)
        yield address, procs[1:]
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        out.close()


def test_sigterm_to_the_dask_worker_cli_commits_the_shard_and_it_resumes_elsewhere(data_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """SIGTERM to the CLI of the worker running a shard, after the shard's first checkpoint: the shard stops,
    commits its finished rows (a 10 s write) and records the interrupted attempt before the worker dies; it runs
    again on the other worker and resumes; every id exactly once.

    The stop must outlast the nanny's 8 s: the first write after the signal takes 10 s on any machine. The shard is
    caught mid-run by a hook, not by its speed: the first worker to finish two rows holds its engine until the stop
    (hold_shard_preload.py), so rows are always in flight at the signal. Without the drain the worker is SIGKILLed
    at 8 s: no end record, no WorkerPreempted reaches the client."""
    from s3_faults import flaky_s3

    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(800, 24)
    ids = table.column("id").to_pylist()
    (tmp_path / "in").mkdir()
    pq.write_table(table, tmp_path / "in" / "in.parquet")
    claim = tmp_path / "hold-claim"  # the held worker process writes its pid here as the hold begins
    with flaky_s3(rate=0.0, lost_rate=0.0) as s3:
        out = f"s3://{s3.bucket}/job"
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        victim: dict[str, str] = {}  # the stopped shard and its worker CLI's pid, set as the signal goes out
        markers: list[str] = []  # "bucket/key" of every checkpoint marker PUT, in arrival order
        marker_put = threading.Condition()

        def delay(environ: dict) -> float:
            path = environ.get("PATH_INFO", "")
            if environ["REQUEST_METHOD"] == "PUT" and re.search(r"/checkpoints/[^/]+/[^/]+\.commit$", path):
                with marker_put:
                    markers.append(path.lstrip("/"))
                    marker_put.notify_all()
            # One slow write: the stopped shard's first attempt's first write after the signal (its last part, or its
            # end record when no row was pending).
            shard = victim.get("shard")
            if (shard and not victim.get("slowed") and environ["REQUEST_METHOD"] == "PUT"
                    and re.search(rf"/(checkpoints/{shard}/a001-|attempts/{shard}/attempt-001\.end)", path)):
                victim["slowed"] = path
                return SLOW_COMMIT_S
            return 0.0

        s3.faults.delay = delay
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   DASK_CONFIG=str(DASK_CONFIG), TOKENMILL_STOP_POLL_S="0.2", HOLD_SHARD_CLAIM=str(claim),
                   HOLD_SHARD_AFTER_ROWS="2")
        with dask_cli_cluster(env, tmp_path / "dask.log", worker_args=("--preload", str(HOLD_PRELOAD))) as (
                address, workers):
            pids = {w.pid: w for w in workers}

            def terminate_the_held_worker() -> None:
                # Woken by the S3 server's request hook (`delay`) at each marker PUT (and every 0.5 s, to see the claim
                # file appear); signals once a marker of the held worker's shard (its attempt's start record names
                # the worker's pid) is in the bucket. The held worker delivers its finished rows before it holds
                # (checkpoint every row), so that marker comes.
                deadline = time.monotonic() + WAIT_S
                others: set[str] = set()  # markers of other workers' shards
                while time.monotonic() < deadline:
                    with marker_put:
                        marker_put.wait(timeout=0.5)
                        todo = [m for m in markers if m not in others]
                    if not claim.exists():
                        continue
                    held = int(claim.read_text())
                    for marker in todo:
                        shard, attempt = marker.split("/")[-2], marker.split("/")[-1][1:4]
                        start = json.loads(fs.cat(f"{s3.bucket}/job/attempts/{shard}/attempt-{attempt}.json"))
                        if start["pid"] != held or attempt != "001":
                            others.add(marker)
                            continue
                        fs.invalidate_cache()
                        if fs.exists(marker):  # else its PUT has not landed yet: look again
                            cli = pids[psutil.Process(held).ppid()]  # the worker process's parent: its CLI
                            victim.update(shard=shard, cli=str(cli.pid))
                            cli.send_signal(signal.SIGTERM)  # as the kubelet does, to the pod's PID 1
                            return

            terminator = threading.Thread(target=terminate_the_held_worker, daemon=True)
            terminator.start()
            run = subprocess.run(
                [sys.executable, "-m", "jobs.cli", "run", str(tmp_path / "in"), out, "--prompt-column", "question",
                 "--max-tokens", "32", "--rows-per-shard", "12", "--checkpoint-rows", "1", "--max-num-seqs", "2",
                 "--kv-cache-gib", "0.25", "--device", "cpu", "--dtype", "float32", "--scheduler", address,
                 "--gpus-per-worker", "1", "--json"],
                env=env, cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S)
            terminator.join()
            assert "shard" in victim, "no shard was caught mid-run"
            stopped_cli = next(w for w in workers if str(w.pid) == victim["cli"])
            assert stopped_cli.wait(timeout=WAIT_S) == 0  # the CLI exits on its own once its nanny has closed
        assert run.returncode == 0, run.stderr[-3000:]
        summary = json.loads(run.stdout.strip().splitlines()[-1])
        assert summary["shards_ok"] == 2 and summary["interruptions"] >= 1

        shard = victim["shard"]
        results = pq.read_table(f"{s3.bucket}/job/results", filesystem=fs).column("id").to_pylist()
        assert sorted(results) == sorted(ids)  # every id exactly once
        # The interrupted attempt ended on its own (a kill leaves no end record) after committing its finished rows,
        # the slow write included: every row it counted is in a part with a commit marker.
        end = json.loads(fs.cat(f"{s3.bucket}/job/attempts/{shard}/attempt-001.end.json"))
        assert end["outcome"] == "interrupted" and end["reason"] == "nanny closing" and victim.get("slowed")
        fs.invalidate_cache()  # the watcher's listings are stale: parts were committed after them
        parts = fs.glob(f"{s3.bucket}/job/checkpoints/{shard}/a001-*.commit")
        assert end["rows_committed"] == sum(int(p.rsplit("-n", 1)[1].split(".")[0]) for p in parts) >= 1
        assert end["rows_committed"] <= 2  # the held engine finished two rows: the next attempt ran the rest
        acct = pq.read_table(f"{s3.bucket}/job/accounting", filesystem=fs).to_pylist()
        (row,) = [r for r in acct if r["shard_id"] == shard]
        assert row["attempts"] >= 2 and row["preemptions"] >= 1 and row["rows_resumed"] == end["rows_committed"]


def test_submit_and_run_reach_the_cluster_in_DASK_SCHEDULER_ADDRESS(data_dir: Path, tmp_path: Path) -> None:
    """The dask-kubernetes operator puts the scheduler's address in DASK_SCHEDULER_ADDRESS: `tokenmill submit` and
    `run` connect there without --scheduler (a real `dask scheduler` with no worker: refused, naming it, after
    waiting TOKENMILL_WORKER_WAIT_S), `submit --output` writes where it says instead of the spec's output, and a run
    waiting for a GPU worker goes on once one joins."""
    from typer.testing import CliRunner

    from jobs.cli import app

    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(0, 4),
                   tmp_path / "in.parquet")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"input: {tmp_path / 'in.parquet'}\noutput: {tmp_path / 'spec-out'}\n"
                    "columns: {prompt: question}\ncluster: {gpus_per_worker: 1}\n")
    env = dict(os.environ, DASK_CONFIG=str(DASK_CONFIG))
    with dask_cli_cluster(env, tmp_path / "dask.log", workers=0) as (address, _):
        runner = CliRunner()
        submitted = runner.invoke(app, ["submit", str(spec), "--output", str(tmp_path / "day-1")],
                                  env={"DASK_SCHEDULER_ADDRESS": address, "TOKENMILL_WORKER_WAIT_S": "1"})
        ran = runner.invoke(app, ["run", str(tmp_path / "in.parquet"), str(tmp_path / "run-out"), "--prompt-column",
                                  "question", "--gpus-per-worker", "1"], env={"DASK_SCHEDULER_ADDRESS": address})
        # Where workers scale from zero, a run waits for the first GPU worker (TOKENMILL_WORKER_WAIT_S).
        with Client(address) as client, ThreadPoolExecutor(1) as pool:
            waited = pool.submit(wait_for_gpu_worker, client, WAIT_S)
            late = subprocess.Popen([str(DASK), "worker", address, "--nthreads", "1", "--resources", "GPU=1",
                                     "--host", "127.0.0.1", "--dashboard-address", ":0"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                assert waited.result(timeout=WAIT_S) is True
            finally:
                late.terminate()
                late.wait(timeout=60)
    for res in (submitted, ran):
        assert res.exit_code == 2 and f"no worker of the cluster at {address} offers a GPU" in res.stderr
    assert "(waited 1 s, TOKENMILL_WORKER_WAIT_S)" in submitted.stderr and "(waited 0 s" in ran.stderr
    assert (tmp_path / "day-1" / "_manifest" / "input.json").is_file() and not (tmp_path / "spec-out").exists()
