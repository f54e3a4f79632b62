"""Shard fixtures shared by the checkpoint, preemption and status tests: 16 real GSM8K rows (one with a null prompt),
an engine that runs them in waves of 4 (so rows finish a few at a time), and the undisturbed run to compare with.

The pipeline's tests check rows, ids, commits, resumes and accounting, not text: `engine` here is the tiny
random-weight model with the real tokenizer (tests/conftest.py `tiny_model`), and TOKENMILL_MODEL names it for the
child processes the tests start."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shard_helpers import NULL_ROW, ROWS, shard_cfg

from engine import EngineConfig, LLMEngine
from pipeline.input import Shard
from pipeline.layout import results_path
from pipeline.shard import run_shard


@pytest.fixture(scope="session")
def engine(tiny_engine: LLMEngine) -> LLMEngine:
    """The tiny stand-in of the real model (module docstring)."""
    return tiny_engine


@pytest.fixture(autouse=True)
def _tiny_model_env(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_MODEL", tiny_model)


@pytest.fixture(scope="session")
def rows_file(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> str:
    """GSM8K test rows 300..315 (id, question) with row NULL_ROW's question nulled (a bad row), in row groups of 5."""
    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(300, ROWS)
    questions = table.column("question").to_pylist()
    questions[NULL_ROW] = None
    path = tmp_path_factory.mktemp("in") / "gsm8k.parquet"
    pq.write_table(table.set_column(1, "question", pa.array(questions, pa.string())), path, row_group_size=5)
    return str(path)


@pytest.fixture(scope="session")
def shard(rows_file: str) -> Shard:
    return Shard("00000-000000000", rows_file, f"file://{rows_file}", 0, ROWS)


@pytest.fixture(scope="session")
def waves(engine: LLMEngine) -> LLMEngine:
    """The session engine limited to 4 rows at a time, so rows finish in waves and a stop lands mid-shard."""
    return engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=4))


@pytest.fixture(scope="session")
def reference(waves: LLMEngine, shard: Shard, tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    """The shard's results from one undisturbed run (one checkpoint at the end)."""
    out = str(tmp_path_factory.mktemp("reference"))
    run_shard(waves, shard, "question", out, shard_cfg(checkpoint_rows=1000))
    return pq.read_table(results_path(out, shard.shard_id))


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free local port, reached through AWS_ENDPOINT_URL as any S3 would be (test credentials
    in the environment); yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}.items():
            mp.setenv(k, v)
        fsspec.filesystem("s3").clear_instance_cache()
        yield endpoint
        fsspec.filesystem("s3").clear_instance_cache()
    server.stop()


@pytest.fixture(scope="module")
def s3_bucket(s3_endpoint: str) -> str:
    """A bucket on the `s3_endpoint` server; yields its name."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.makedirs("tokenmill-test", exist_ok=True)  # moto's backend is process-wide: another module made it
    return "tokenmill-test"
