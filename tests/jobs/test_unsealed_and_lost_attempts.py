"""`tokenmill status` after an unclean stop: "done" only once OUTPUT/_SUCCESS seals the job, else "unsealed" (every
shard committed) with the way out; and an attempt killed before its first checkpoint or heartbeat still on the bill,
at the next attempt and at `status`."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from engine import LLMEngine
from jobs.cli import app
from jobs.control import job_status
from pipeline.config import RunConfig
from pipeline.layout import start_path
from pipeline.manifest import pin_manifest
from pipeline.shard import run_shard
from pipeline.storage import commit_json, output_fs

runner = CliRunner()
ROWS = 4


@pytest.fixture()
def src(tmp_path: Path, data_dir: Path) -> str:
    path = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(820, ROWS), path)
    return str(path)


def _cfg() -> RunConfig:
    return RunConfig(prompt_column="question", max_tokens=2, rows_per_shard=2)


def _killed_attempt(out: str, shard_id: str, attempt: int, started_s_ago: float) -> None:
    """The start record of an attempt killed before its first part or heartbeat (nothing else of it exists)."""
    fs, root = output_fs(out)
    commit_json(fs, start_path(root, shard_id, attempt), {
        "attempt": attempt, "started_at": time.time() - started_s_ago, "host": socket.gethostname(), "pid": 1,
        "nonce": "killed", "heartbeat_s": 15.0})


def test_every_shard_committed_without_success_is_unsealed_until_the_rerun_seals_it(
        engine: LLMEngine, src: str, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    manifest, _ = pin_manifest(out, src, _cfg())
    for shard in manifest.shards():  # every shard committed; the run stopped before _SUCCESS (a SIGQUIT, say)
        run_shard(engine, shard, "question", out, _cfg())
    st = job_status(out)
    assert (st.state, st.exit_code, st.shards["done"]) == ("unsealed", 5, 2)
    res = runner.invoke(app, ["status", out])
    assert res.exit_code == 5 and "complete, not sealed" in res.output and "run the same command" in res.output

    res = runner.invoke(app, ["run", src, out, "--prompt-column", "question", "--max-tokens", "2",
                              "--rows-per-shard", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "_SUCCESS").is_file()
    assert (job_status(out).state, runner.invoke(app, ["status", out]).exit_code) == ("done", 0)


def test_an_attempt_killed_before_any_sign_of_life_is_billed(engine: LLMEngine, src: str, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    manifest, _ = pin_manifest(out, src, _cfg())
    first, second = manifest.shards()
    _killed_attempt(out, first.shard_id, 1, started_s_ago=11.0)
    _killed_attempt(out, second.shard_id, 1, started_s_ago=100.0)
    # At `status`: the killed attempt of the unfinished shard counts one heartbeat interval (it ran less than that;
    # a live attempt leaves a sign that often), bounded by now.
    st = job_status(out)
    assert st.device_s_unfinished == pytest.approx(15.0 + 11.0, abs=1.0)
    assert json.loads(runner.invoke(app, ["status", out, "--json"]).stdout)["device_s_unfinished"] > 25.0

    # At the next attempt: billed from its start record to the next attempt's start, at most one interval.
    acct = run_shard(engine, first, "question", out, _cfg())
    assert acct["attempt"] == 2 and acct["preemptions"] == 1
    earlier = acct["device_s_billed"] - acct["device_s"]
    assert 11.0 <= earlier <= 15.0 and acct["device_s_lost"] == pytest.approx(earlier)
