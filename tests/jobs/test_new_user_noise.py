"""What a new user sees from the real `tokenmill` command (issue 26 items 12, 14, 15), on real GSM8K rows: a
--max-model-len the model cannot honour is refused before any work; an option set by a bad TOKENMILL_* variable
names the variable and the option; a cancel is no Dask "Compute Failed" traceback and two jobs on one machine do
not fight over the dashboard port; a rerun's summary keeps its own work apart from the job's totals.

The refusals run the CLI in this process (typer's CliRunner, the TOKENMILL_* variables set for the call): they end
in the command's own checks before any cluster or worker starts, so a child process would add only its start-up
(about 4 CPU-s each: Python, the CLI, torch) and prove nothing more. The runs that start clusters (the cancel, the
two jobs side by side) stay real processes. The rerun's point is its summary, which the client computes: it runs in
this process on the session's LocalCluster (`shared_cluster`, tests/jobs/conftest.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from held_shard import held_pid, preload_env
from typer.testing import CliRunner, Result

from engine import LLMEngine
from engine.loading.gguf_header import gguf_metadata
from jobs.cli import app
from jobs.cli.run_output import this_run
from jobs.control import cancel_job
from jobs.plan.preflight import model_context
from jobs.preemption_plugin import WORKER_LOGGER, QuietHeartbeat, quiet_heartbeat
from jobs.summary import JobSummary
from pipeline.config import RunConfig
from pipeline.manifest import pin_manifest
from pipeline.shard import run_shard

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 600.0


@pytest.fixture()
def questions(tmp_path: Path, data_dir: Path) -> Path:
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(500, 8), path)
    return path


def _env(**extra: str) -> dict[str, str]:
    """This environment (TOKENMILL_MODEL: the tiny model, tests/jobs/conftest.py) with our code first."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)


def _refused(args: list[str], **env: str) -> Result:
    """`tokenmill ARGS` in this process with the TOKENMILL_* variables `env` set for the call (module docstring)."""
    return CliRunner().invoke(app, args, env=env)


def _tokenmill(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=WAIT_S)


def test_the_gguf_header_scan_reads_what_gguf_reader_reads(gguf_path: str, tmp_path: Path) -> None:
    """jobs.plan.preflight reads the model's context from the GGUF header alone; the values are GGUFReader's. A file cut
    short is a ValueError, not a wrong default."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    keys = ["llama.context_length", "llama.block_count", "llama.attention.head_count_kv", "general.architecture"]
    assert gguf_metadata(gguf_path, set(keys)) == {k: reader.fields[k].contents() for k in keys}
    assert model_context(gguf_path)["context"] == reader.fields["llama.context_length"].contents() == 8192
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        cut.write_bytes(f.read(300))
    with pytest.raises(ValueError, match="cut short"):
        gguf_metadata(str(cut), set(keys))


def test_a_max_model_len_the_model_cannot_honour_is_refused_before_any_work(questions: Path, tmp_path: Path) -> None:
    """--max-model-len 10000000 used to be cut to the model's 8192 tokens without a word. Now: exit 2 naming the
    option, the model's context and the fix, nothing written; the same from TOKENMILL_MAX_MODEL_LEN names the
    variable too; and on the CPU a value the KV cache of --kv-cache-gib cannot hold names --kv-cache-gib."""
    out = tmp_path / "out"
    base = ["run", str(questions), str(out), "--prompt-column", "question", "--device", "cpu"]
    flag = _refused([*base, "--max-model-len", "10000000"])
    assert flag.exit_code == 2, flag.output
    assert "--max-model-len 10000000 is more than the context of" in flag.stderr and "8192 tokens" in flag.stderr
    assert "give at most 8192" in flag.stderr and "Traceback" not in flag.stderr
    env = _refused(base, TOKENMILL_MAX_MODEL_LEN="10000000")
    assert env.exit_code == 2 and "--max-model-len" in env.stderr and "TOKENMILL_MAX_MODEL_LEN" in env.stderr
    pool = _refused([*base, "--max-model-len", "8192", "--kv-cache-gib", "0.0001", "--dtype", "float32"])
    assert pool.exit_code == 2 and "more than the KV cache of --kv-cache-gib 0.0001" in pool.stderr, pool.stderr
    assert not out.exists()


def test_a_bad_tokenmill_variable_names_the_variable_and_the_option(questions: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = ["run", str(questions), str(out), "--prompt-column", "question"]
    bad = _refused([*base, "--max-num-seqs", "0"], TOKENMILL_DEVICE="gpu")
    assert bad.exit_code == 2
    assert "invalid tokenmill run options (2 problems)" in bad.stderr  # was "options is invalid"
    assert "engine.device (--device, set by the environment variable TOKENMILL_DEVICE)" in bad.stderr
    assert "engine.max_num_seqs (--max-num-seqs):" in bad.stderr  # from the command line: no variable named
    missing = _refused(base, TOKENMILL_MODEL=str(tmp_path / "nonexistent.gguf"))
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    assert "--model was set by the environment variable TOKENMILL_MODEL" in missing.stderr
    if not torch.cuda.is_available():  # a CUDA device this machine lacks: refused here, not a worker traceback
        cuda = _refused(base, TOKENMILL_DEVICE="cuda")
        assert cuda.exit_code == 2 and "--device cuda: this machine has no CUDA device" in cuda.stderr, cuda.stderr
        assert "TOKENMILL_DEVICE" in cuda.stderr and "Compute Failed" not in cuda.stderr
    assert not out.exists()


def test_a_cancel_is_quiet_and_two_jobs_on_one_machine_share_it(tmp_path: Path, data_dir: Path) -> None:
    """Job A (long) runs while job B (short) runs beside it: each LocalCluster takes a free dashboard port and says
    where once (no "Port 8787 is already in use"). Then A is cancelled: exit 4 and its message, and no Dask
    "Compute Failed ... ShardInterrupted" traceback on stderr (an interrupted shard is an outcome, not an error).

    B starts once A's cluster is up (A's dashboard line: its port is taken), while A's worker loads, instead of after
    A's first row: the clusters overlap all the same, and A is not generating rows beside all of B's run. A's worker
    holds its shard after the first row until the cancel (hold_shard_preload.py): A cannot finish first, and the
    cancel lands mid-shard, however fast or loaded the machine is."""
    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"])
    long_in, short_in = tmp_path / "long.parquet", tmp_path / "short.parquet"
    pq.write_table(table.slice(0, 8), long_in)
    pq.write_table(table.slice(400, 2), short_in)
    env = _env(TOKENMILL_STOP_POLL_S="0.2")
    common = ["--prompt-column", "question", "--device", "cpu", "--max-num-seqs", "1", "--json"]
    claim = tmp_path / "hold-claim"
    a = subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", str(long_in), str(tmp_path / "a"), *common,
                          "--max-tokens", "16", "--checkpoint-rows", "1"], env={**env, **preload_env(claim, 1)},
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert a.stderr is not None
        a_err = []
        a_stderr_lines = a.stderr

        def read_until(event: str) -> None:
            for line in a_stderr_lines:
                a_err.append(line)
                if line.startswith(f'{{"event": "{event}"'):
                    return
            raise AssertionError(f"job A exited before its {event} line: {''.join(a_err)}")

        read_until("dashboard")  # A's cluster is up: its dashboard port is taken
        b = _tokenmill(["run", str(short_in), str(tmp_path / "b"), *common, "--max-tokens", "4"], env, tmp_path)
        held_pid(claim, lambda: a.poll() is None)  # A's shard is held after its first row: the cancel lands mid-shard
        assert a.poll() is None, "job A finished before job B: the jobs did not overlap"
        cancel_job(str(tmp_path / "a"))
        _, rest = a.communicate(timeout=WAIT_S)
    finally:
        if a.poll() is None:
            a.kill()
    a_stderr = "".join(a_err) + rest
    assert b.returncode == 0, b.stderr
    assert a.returncode == 4, a_stderr
    assert "the job was cancelled" in a_stderr
    for stderr in (a_stderr, b.stderr):
        assert "Compute Failed" not in stderr and "Traceback" not in stderr and "already in use" not in stderr
        assert "terminate called" not in stderr  # no worker aborted at exit (engine.loop.engine_loop's atexit hook)
        # Not a terminal: the dashboard is said once, as a JSON event line like the progress events.
        assert len(re.findall(r'\{"event": "dashboard", "url": "http://127\.0\.0\.1:\d+/status"', stderr)) == 1
    ports = [re.search(r"127\.0\.0\.1:(\d+)", s).group(1) for s in (a_stderr, b.stderr)]
    assert ports[0] != ports[1]


def test_a_heartbeat_lost_while_the_cluster_closes_prints_no_traceback() -> None:
    """Dask's worker logs "Failed to communicate with scheduler during heartbeat." with its traceback at ERROR when a
    heartbeat is in flight as the job's cluster closes (seen once in a full run on a loaded 2-core machine, in the
    stderr of the cancel test above). Logged the way distributed.worker.Worker.heartbeat logs it, in a worker
    process set up as tokenmill's (jobs.preemption_plugin.quiet_heartbeat): dropped under the cluster's
    silence_logs=ERROR, one line without the traceback at INFO."""
    logger = logging.getLogger(WORKER_LOGGER)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    level, filters = logger.level, list(logger.filters)
    logger.addHandler(handler)
    try:
        quiet_heartbeat()
        quiet_heartbeat()  # once per process, however many plugins set up
        assert sum(isinstance(f, QuietHeartbeat) for f in logger.filters) == 1
        for worker_level in (logging.ERROR, logging.INFO):
            logger.setLevel(worker_level)
            try:
                raise OSError("Stream is closed")
            except OSError:
                logger.exception("Failed to communicate with scheduler during heartbeat.")
                logger.exception("Unexpected exception during heartbeat. Closing worker.")  # a real error: kept
        assert [(r.levelname, r.exc_info is None, r.getMessage()[:22]) for r in seen] == [
            ("ERROR", False, "Unexpected exception d"),
            ("WARNING", True, "Failed to communicate "), ("ERROR", False, "Unexpected exception d")]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.filters[:] = filters


def test_a_rerun_reports_its_own_work_apart_from_the_job_totals(tmp_path: Path, questions: Path,
                                                                 engine: LLMEngine, shared_cluster: str) -> None:
    """Shard 0 of 2 was committed by an earlier run; the rerun generates shard 1 only. Its summary gives the job's
    rows and tokens (both shards) and, apart, this run's rows, tokens and tokens/s (shard 1 over this run's wall
    time). It used to divide the job's tokens by the rerun's seconds."""
    out = tmp_path / "out"
    cfg = RunConfig(prompt_column="question", max_tokens=5, rows_per_shard=4)
    manifest, _ = pin_manifest(str(out), str(questions), cfg)
    first = run_shard(engine, manifest.shards()[0], "question", str(out), cfg)
    rerun = CliRunner().invoke(app, ["run", str(questions), str(out), "--prompt-column", "question", "--max-tokens",
                                     "5", "--rows-per-shard", "4", "--device", "cpu", "--scheduler", shared_cluster,
                                     "--json"])
    assert rerun.exit_code == 0, rerun.output
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    acc = pq.read_table(out / "accounting").to_pylist()
    assert summary["rows"] == 8 and summary["output_tokens"] == sum(r["output_tokens"] for r in acc) == 40
    second = next(r for r in acc if r["shard_id"] != first["shard_id"])
    assert (summary["run_rows"], summary["run_output_tokens"]) == (4, second["output_tokens"]) == (4, 20)
    assert summary["output_tokens_per_s"] == pytest.approx(20 / summary["wall_s"], rel=0.01)

    shown = JobSummary(rows=8, output_tokens=40, wall_s=2.0, run_rows=4, run_output_tokens=20)
    assert this_run(shown) == "4 rows, 20 output tokens generated in 2.0 s wall time (10.0 output tokens/s)"
    assert this_run(JobSummary(already_done=True)) == "nothing to do: the job had finished"



def test_a_preempted_shard_logs_no_compute_failed_but_a_real_error_does() -> None:
    """On a real (in-process) Dask worker with the PreemptionPlugin: a task that raises WorkerPreempted reaches the
    client as that error, with no "Compute Failed" record in the worker's log; a task that fails for real is still
    logged."""
    from distributed import Client, LocalCluster

    from jobs.plugin import WORKER_LOGGER, PreemptionPlugin, WorkerPreempted

    def preempted() -> None:
        raise WorkerPreempted(2, 3, "tcp://worker", "SIGTERM")

    def broken() -> None:
        raise ValueError("a real bug")

    records: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(WORKER_LOGGER).addHandler(handler)  # Dask's loggers do not propagate to pytest's
    try:
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                          dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
            client.register_plugin(PreemptionPlugin(), name=PreemptionPlugin.name)
            with pytest.raises(WorkerPreempted):
                client.submit(preempted, pure=False).result()
            with pytest.raises(ValueError):
                client.submit(broken, pure=False).result()
    finally:
        logging.getLogger(WORKER_LOGGER).removeHandler(handler)
    failed = [r for r in records if r.startswith("Compute Failed")]
    assert len(failed) == 1 and "a real bug" in failed[0]


def test_run_help_and_the_missing_model_error_name_every_kind_of_model(tmp_path) -> None:  # noqa: ANN001
    """`run --help` and a missing --model name GGUF files, Hugging Face folders, quantize folders, URLs and hub ids
    (before: only GGUF files and quantize folders)."""
    from typer.testing import CliRunner

    from jobs.cli import app

    runner = CliRunner()
    helped = " ".join(runner.invoke(app, ["run", "--help"], terminal_width=400).output.split())
    assert "Hugging Face folder" in helped and "s3://" in helped and "hub id" in helped
    res = runner.invoke(app, ["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--model",
                              str(tmp_path / "missing.gguf")])
    assert res.exit_code == 2
    line = " ".join(res.output.split())
    assert "Hugging Face folder" in line and "s3://" in line and "hub id" in line
