"""Job metrics pushed to a real Prometheus Pushgateway (Debian's prometheus-pushgateway, started on 127.0.0.1) and
written as a node_exporter textfile, read back and checked against the job's own summary. The job checks what its
client pushes and writes, not its own cluster: it runs on the session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from jobs.cli import app
from jobs.metrics import JobMetrics, model_label
from jobs.summary import JobSummary

runner = CliRunner()
PUSHGATEWAY = shutil.which("prometheus-pushgateway")
READY_WAIT_S = 120.0  # a hang guard only: the server is ready in well under a second when the machine is quiet


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def pushgateway(tmp_path: Path) -> Iterator[str]:
    """A real Pushgateway on 127.0.0.1 (a free port), its URL; stopped after the test."""
    if PUSHGATEWAY is None:
        pytest.skip("prometheus-pushgateway is not installed (apt-get install prometheus-pushgateway)")
    port = _free_port()
    proc = subprocess.Popen([PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}",
                             f"--persistence.file={tmp_path / 'pushgateway.data'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_WAIT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"prometheus-pushgateway exited: {proc.stderr.read().decode()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"prometheus-pushgateway did not become ready in {READY_WAIT_S:g} s")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _series(text: str, job: str | None = None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without job/instance): value} of exposition `text` (of `job` only, if given)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("tokenmill_") or s.name.endswith("_created"):
                continue
            if job is not None and s.labels.get("job") != job:
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("job", "instance")))
            out[(s.name, labels)] = s.value
    return out


def _gateway(url: str, job: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return _series(r.read().decode(), job)


def test_progress_is_pushed_as_the_run_goes(pushgateway: str) -> None:
    m = JobMetrics("nightly", "m.gguf", pushgateway_url=pushgateway, interval_s=0)
    m.start(10)
    m.progress(3, 40)
    got = _gateway(pushgateway, "nightly")
    assert got[("tokenmill_rows_planned", (("model", "m.gguf"),))] == 10
    assert got[("tokenmill_rows_done", (("model", "m.gguf"),))] == 3
    assert ("tokenmill_last_success_timestamp_seconds", (("model", "m.gguf"),)) not in got
    # A run that ends with a failed shard leaves no success time; a later successful one sets it.
    m.finish(JobSummary(shards=2, shards_ok=1, failed={"00001-000000000": "ShardError"}, rows=10, rows_ok=5))
    got = _gateway(pushgateway, "nightly")
    assert got[("tokenmill_shards", (("model", "m.gguf"), ("state", "failed")))] == 1
    assert ("tokenmill_last_success_timestamp_seconds", (("model", "m.gguf"),)) not in got
    JobMetrics("nightly", "m.gguf", pushgateway_url=pushgateway).finish(JobSummary(shards=1, shards_ok=1, rows=5))
    assert _gateway(pushgateway, "nightly")[("tokenmill_last_success_timestamp_seconds", (("model", "m.gguf"),))] \
        == pytest.approx(time.time(), abs=60)


def test_bad_metrics_file_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"must end in \.prom"):
        JobMetrics("j", "m", metrics_file=str(tmp_path / "metrics.txt"))


def test_a_job_pushes_its_totals_and_writes_a_textfile(pushgateway: str, tmp_path: Path, data_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch, shared_cluster: str) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(300, 6), src)
    out, prom = tmp_path / "gsm8k-nightly", tmp_path / "tokenmill.prom"
    monkeypatch.setenv("TOKENMILL_PUSHGATEWAY_URL", pushgateway)
    res = runner.invoke(app, ["run", str(src), str(out), "--prompt-column", "question", "--max-tokens", "5",
                              "--rows-per-shard", "3", "--price-per-hour", "3.0", "--metrics-file", str(prom),
                              "--scheduler", shared_cluster, "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    acc = pq.read_table(out / "accounting").to_pylist()
    model = acc[0]["model"]
    assert model == model_label(os.environ.get("TOKENMILL_MODEL"))  # the label names the model the accounting names

    pushed = _gateway(pushgateway, "gsm8k-nightly")  # the job name: the last part of OUTPUT
    assert pushed == _series(prom.read_text())  # the textfile holds the same series
    lab = (("model", model),)
    assert pushed[("tokenmill_rows_total", (*lab, ("status", "ok")))] == summary["rows_ok"] == 6
    assert pushed[("tokenmill_rows_total", (*lab, ("status", "error")))] == 0
    assert pushed[("tokenmill_rows_done", lab)] == pushed[("tokenmill_rows_planned", lab)] == 6
    assert pushed[("tokenmill_input_tokens_total", lab)] == summary["input_tokens"] == sum(
        r["input_tokens"] for r in acc)
    assert pushed[("tokenmill_output_tokens_total", lab)] == summary["output_tokens"] == 30
    assert pushed[("tokenmill_cost_usd_total", lab)] == pytest.approx(sum(r["cost_usd"] for r in acc))
    billed = sum(r["device_s_billed"] for r in acc)
    assert pushed[("tokenmill_device_seconds_billed_total", lab)] == pytest.approx(billed)
    assert pushed[("tokenmill_tokens_per_dollar", lab)] == pytest.approx(summary["tokens_per_dollar"], rel=1e-3)
    assert pushed[("tokenmill_attempts_total", lab)] == 2 and pushed[("tokenmill_preemptions_total", lab)] == 0
    assert pushed[("tokenmill_shards", (*lab, ("state", "ok")))] == 2
    assert pushed[("tokenmill_output_tokens_per_second", lab)] == pytest.approx(summary["output_tokens_per_s"],
                                                                                rel=1e-2)
    assert pushed[("tokenmill_last_success_timestamp_seconds", lab)] == pytest.approx(time.time(), abs=120)
