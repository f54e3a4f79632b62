"""Real GSM8K rows as a Parquet input for job tests (tests/ is on sys.path: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq


def write_gsm8k(data_dir: Path, folder: Path, start: int, n: int) -> list[str]:
    """Write n real GSM8K rows (id, question) from row `start` to folder/in.parquet; return their ids."""
    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(start, n)
    folder.mkdir(parents=True)
    pq.write_table(table, folder / "in.parquet")
    return table.column("id").to_pylist()
