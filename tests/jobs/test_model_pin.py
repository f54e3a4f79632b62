"""The model is pinned (issue 26 item 1): a resume whose model changed is refused before any work, a worker whose
engine loaded another model fails its shard instead of writing rows, and every result and accounting row carries
the model's fingerprint. Real GSM8K rows, real processes (the CLI in a child process, Dask workers), real files.

The runs whose point is the pin, not their own cluster, run on the session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py): a worker that outlives a job, as a real cluster's does. The cancelled first run of the
model-bytes test is a `tokenmill run --scheduler` child process there, held mid-shard by hold_shard_preload.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from distributed import Client
from gguf_models import MIXES, tokenizer_fields, write_tiny_llama
from gsm8k_rows import write_gsm8k
from held_shard import armed, held_attempts
from typer.testing import CliRunner

from engine import EngineConfig, LLMEngine
from jobs.cli import app
from jobs.cluster import ClusterOptions, RunContext, run_on_cluster
from jobs.control import cancel_job, job_status
from jobs.errors import JobError
from jobs.lease import Lease
from jobs.runner import run_job
from jobs.summary import JobProgress, JobSummary
from pipeline.config import RunConfig
from pipeline.manifest import InputManifest, pin_manifest
from pipeline.model_pin import ModelPin, fingerprint_model, pin_model
from pipeline.shard import run_shard

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 600.0  # generous: a loaded CI box; the tests never assert on time
ENGINE = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=64 << 20)


def _files(out: Path) -> dict[str, int]:
    """Every file under OUTPUT (relative path -> size): what a refused run must leave as it was."""
    return {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}


def _rewrite_tail(path: Path, n: int = 64) -> None:
    """Other bytes, same name and size: the file's last n bytes become finite values (bf16 1.0, or zeros where they
    were that already), so the model still loads."""
    data = bytearray(path.read_bytes())
    ones = b"\x80\x3f" * (n // 2)
    data[-n:] = bytes(n) if data[-n:] == ones else ones
    path.write_bytes(bytes(data))


def _pinned_job(tiny_model: str, data_dir: Path, tmp_path: Path,
                start: int) -> tuple[Path, str, str, RunConfig, InputManifest, ModelPin]:
    """A job as its first start leaves it: 8 real GSM8K rows from `start` in two shards of 4 under tmp_path/in, a
    copy of the tiny model folder at tmp_path/tiny (this test may rewrite it), input and model pinned under
    tmp_path/out. Returns (model folder, input, OUTPUT, options, manifest, model pin)."""
    write_gsm8k(data_dir, tmp_path / "in", start, 8)
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model, model)
    inp, out = str(tmp_path / "in"), str(tmp_path / "out")
    cfg = RunConfig(prompt_column="question", max_tokens=4, rows_per_shard=4)
    manifest, _ = pin_manifest(out, inp, cfg)
    pin, _ = pin_model(out, fingerprint_model(str(model)))
    return model, inp, out, cfg, manifest, pin


@pytest.fixture(scope="module")
def tiny_gguf(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF (tests/gguf_models.py: 2 layers of width 256, Q4_K_M's tensor types, random weights) with the
    real model's tokenizer and chat template: a single-file model as a user's `--model model.gguf` is, which
    workers load in a fraction of the real one's time (these tests check pins, not text)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama(path, MIXES["Q4_K_M"], tokenizer_fields(gguf_path))
    return path


def _cli(*args: str) -> list[str]:
    """`tokenmill ARGS` in a child process."""
    return [sys.executable, "-m", "jobs.cli", *args]


def test_a_resume_with_other_model_bytes_is_refused_and_the_restored_model_finishes(
        tiny_gguf: Path, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        shared_cluster: str) -> None:
    """The issue's scenario: `tokenmill run --model model.gguf`, cancelled after its first commit; model.gguf is
    rewritten (same name, same size, other bytes); `--resume` exits 2 with one line naming the file, its old and new
    size and hash and the two ways out, and writes nothing. With the model restored, `--resume` finishes, and every
    row (the first run's and the resumed ones) and every accounting row carries the pinned fingerprint.
    Before: exit 0, _SUCCESS, the later rows from the other model."""
    ids = write_gsm8k(data_dir, tmp_path / "in", 500, 8)
    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_gguf, model)  # a copy: this test rewrites it
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENMILL_STOP_POLL_S="0.2", TOKENMILL_CACHE_DIR=str(tmp_path / "c"),
               TOKENMILL_WEIGHTS_CACHE="0")
    env.pop("TOKENMILL_MODEL", None)
    args = ["run", "in", "out", "--model", "model.gguf", "--prompt-column", "question", "--max-tokens", "8",
            "--rows-per-shard", "4", "--checkpoint-rows", "1", "--max-num-seqs", "1", "--device", "cpu",
            "--dtype", "float32", "--workers", "1", "--json"]

    # The first run, a child process, on the session's cluster: its point is the pin it leaves, not its own cluster.
    # The worker holds the shard after its first row (hold_shard_preload.py): the cancel always lands mid-job.
    log = tmp_path / "first.stderr"
    with Client(shared_cluster) as client, armed(client, tmp_path / "hold-claim", after_rows=1):
        with log.open("w") as stderr:
            first = subprocess.Popen(_cli(*args, "--scheduler", shared_cluster), env=env, cwd=tmp_path,
                                     stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            held_attempts(out, tmp_path / "hold-claim", running=lambda: first.poll() is None)  # first row committed
            cancel_job(str(out), "test")
            first.wait(timeout=WAIT_S)
        finally:
            if first.poll() is None:
                first.kill()
    assert first.returncode == 4, log.read_text()[-3000:]  # cancelled, its first rows committed
    pin = json.loads((out / "_manifest" / "model.json").read_text())
    assert pin["model"] == str(model) and pin["resolved"] == str(model)
    assert pin["files"][0]["size"] == model.stat().st_size
    before = _files(out)
    assert any(name.startswith("checkpoints/") for name in before) and not (out / "_SUCCESS").exists()

    size = model.stat().st_size
    _rewrite_tail(model)
    assert model.stat().st_size == size
    # The refusal and the status read run the CLI in this process: both end before any cluster or model load, so a
    # child process would add only its start-up.
    monkeypatch.chdir(tmp_path)
    cli_env = {k: env.get(k) for k in ("TOKENMILL_STOP_POLL_S", "TOKENMILL_CACHE_DIR", "TOKENMILL_WEIGHTS_CACHE",
                                       "TOKENMILL_MODEL")}
    refused = CliRunner().invoke(app, [*args, "--resume"], env=cli_env)
    assert refused.exit_code == 2, refused.output[-3000:]
    line = refused.stderr.strip()
    assert "\n" not in line and "model.gguf was" in line and f"{size} bytes" in line
    assert pin["files"][0]["digest"].removeprefix("sha256:")[:16] in line
    assert "Restore the model" in line and "new OUTPUT" in line
    assert _files(out) == before  # nothing written: no lease, no attempt, no rows

    shutil.copyfile(tiny_gguf, model)
    # The resume in this process too, on the session's cluster: its checks are what the job wrote and pinned. The
    # worker keeps the first run's engine (the same bytes, the same pin), as a long-lived cluster's worker does.
    done = CliRunner().invoke(app, [*args, "--resume", "--scheduler", shared_cluster], env=cli_env)
    assert done.exit_code == 0, done.output[-3000:]
    assert (out / "_SUCCESS").is_file()
    rows = pq.read_table(out / "results").to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(ids)
    assert {r["model_fingerprint"] for r in rows} == {pin["fingerprint"]} and {r["model"] for r in rows} == {
        "model.gguf"}
    assert {r["model_fingerprint"] for r in pq.read_table(out / "accounting").to_pylist()} == {pin["fingerprint"]}
    status = CliRunner().invoke(app, ["status", "out", "--json"], env=cli_env)
    assert json.loads(status.stdout)["model"]["fingerprint"] == pin["fingerprint"]


def test_a_folder_model_changed_in_one_weight_file_is_refused_and_unchanged_it_resumes(
        tiny_model: str, engine: LLMEngine, data_dir: Path, tmp_path: Path, shared_cluster: str) -> None:
    """A job on a model folder whose first shard is committed: with one weight file rewritten the run is refused
    (exit 2, naming model.safetensors), nothing written; with the folder as pinned it resumes, running only the
    second shard."""
    model, inp, out, cfg, manifest, pin = _pinned_job(tiny_model, data_dir, tmp_path, 520)
    first, second = manifest.shards()
    # The session's engine loaded the original folder: the same bytes, the same model as the copy.
    run_shard(engine, first, "question", out, cfg, model_fingerprint=pin.fingerprint)
    before = _files(Path(out))

    original = (model / "model.safetensors").read_bytes()
    _rewrite_tail(model / "model.safetensors")
    with pytest.raises(JobError) as refused:
        run_job(inp, out, cfg, model=str(model), engine_config=ENGINE)
    assert refused.value.exit_code == 2
    assert "model.safetensors was" in str(refused.value) and "tokenizer" not in str(refused.value)
    assert _files(Path(out)) == before

    (model / "model.safetensors").write_bytes(original)  # restored: other mtime, the same bytes
    summary = run_job(inp, out, cfg, model=str(model), engine_config=ENGINE, scheduler_address=shared_cluster)
    assert summary.shards_ok == 2 and not summary.failed and not summary.model_note
    assert (Path(out) / "_SUCCESS").is_file()
    rows = pq.read_table(Path(out) / "results").to_pylist()
    assert len(rows) == 8 and {r["model_fingerprint"] for r in rows} == {pin.fingerprint}
    accounting = {r["shard_id"]: r for r in pq.read_table(Path(out) / "accounting").to_pylist()}
    assert accounting[first.shard_id]["attempt"] == 1 and accounting[second.shard_id]["attempt"] == 1
    assert job_status(out).model["fingerprint"] == pin.fingerprint


def test_a_worker_that_loaded_another_model_fails_its_shard_without_rows(
        tiny_model: str, data_dir: Path, tmp_path: Path, shared_cluster: str) -> None:
    """The client's pin says one model; the file at that path holds other bytes by the time the worker loads it
    (a remote worker's disk, a file replaced after the check): each shard fails with ModelChanged, naming the file,
    and no row, checkpoint or results file is written."""
    model, _inp, out, cfg, manifest, pin = _pinned_job(tiny_model, data_dir, tmp_path, 540)
    _rewrite_tail(model / "model.safetensors")

    summary = JobSummary()
    with Lease(out) as lease:
        run = RunContext(out, cfg, manifest.prompt_column, {f.url: f for f in manifest.files}, summary,
                         JobProgress("pin-test", None), lease, pin)
        run_on_cluster(manifest.shards(), run, str(model), ENGINE, ClusterOptions(scheduler_address=shared_cluster))
    assert summary.shards_ok == 0 and set(summary.failed) == {s.shard_id for s in manifest.shards()}
    for error in summary.failed.values():
        assert error.startswith("ModelChanged:") and "loaded another model" in error
        assert "model.safetensors was" in error
    assert not list(Path(out).glob("results/*")) and not list(Path(out).glob("checkpoints/*/*"))
    status = job_status(out)
    assert status.shards["failed"] == 2 and all("ModelChanged" in e or "model.safetensors" in e
                                                for e in status.failed.values())


def test_a_job_pinned_before_models_were_pinned_resumes_and_pins_it(
        tiny_model: str, engine: LLMEngine, data_dir: Path, tmp_path: Path, shared_cluster: str) -> None:
    """An OUTPUT written by a tokenmill that pinned no model (no _manifest/model.json, rows without a fingerprint)
    still resumes: the run pins the model it runs now and says so (summary.model_note); its rows carry the
    fingerprint, the earlier rows stay null."""
    write_gsm8k(data_dir, tmp_path / "in", 560, 8)
    inp, out = str(tmp_path / "in"), str(tmp_path / "out")
    cfg = RunConfig(prompt_column="question", max_tokens=4, rows_per_shard=4)
    manifest, _ = pin_manifest(out, inp, cfg)
    first, _second = manifest.shards()
    run_shard(engine, first, "question", out, cfg)  # as an older tokenmill did: no model pin, no fingerprint
    assert job_status(out).model is None

    summary = run_job(inp, out, cfg, model=tiny_model, engine_config=ENGINE, scheduler_address=shared_cluster)
    assert summary.shards_ok == 2 and not summary.failed
    assert "did not pin its model" in summary.model_note and tiny_model in summary.model_note
    pinned = job_status(out).model
    assert pinned is not None and pinned["fingerprint"] == fingerprint_model(tiny_model).fingerprint
    rows = pq.read_table(Path(out) / "results").to_pylist()
    assert sorted({str(r["model_fingerprint"]) for r in rows}) == sorted({"None", pinned["fingerprint"]})
