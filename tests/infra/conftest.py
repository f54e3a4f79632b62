"""Fixtures of the infra/ tests: a small real job (GSM8K rows on the CPU engine) as a job spec. These tests are about
processes, locks, exit codes and reruns, not text: the job runs the tiny random-weight model with the real tokenizer
(tests/conftest.py `tiny_model`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_job(data_dir: Path, tmp_path: Path, tiny_model: str) -> Path:
    """A job spec of 4 real GSM8K rows in 2 shards, 8 tokens each, on the CPU engine (fp32, small KV pool) with the
    tiny model: a run takes seconds. Its output is tmp_path/out unless overridden with --output."""
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(900, 4),
                   tmp_path / "in.parquet")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"""input: {tmp_path / "in.parquet"}
output: {tmp_path / "out"}
model: {tiny_model}
columns: {{prompt: question}}
sampling: {{max_tokens: 8}}
sharding: {{rows_per_shard: 2}}
engine: {{device: cpu, dtype: float32, max_num_seqs: 2, kv_cache_gib: 0.25}}
""")
    return spec


@pytest.fixture
def tokenmill_env() -> dict[str, str]:
    """The environment a scheduler (cron, Airflow) gives tokenmill: this venv's bin first on PATH (the `tokenmill`
    entry point), this checkout first on PYTHONPATH, the CPU engine's plain torch path (no kernel build to wait for;
    these tests are about processes, not speed or text)."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "tokenmill").is_file():
        pytest.fail(f"no tokenmill entry point beside {sys.executable}: pip install -e . in that venv")
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), TOKENMILL_CPU_KERNELS="0")
