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


def write_gsm8k_blanked(data_dir: Path, path: Path, start: int, n: int, columns: list[str], blank: str,
                        row: int) -> Path:
    """Write n real GSM8K rows of `columns` from row `start` to `path`, the text of column `blank` emptied in row
    `row` (an error row of an embed, classify or score job); return `path`."""
    import pyarrow as pa

    table = pq.read_table(data_dir / "gsm8k_test.parquet", columns=columns).slice(start, n)
    texts = table.column(blank).to_pylist()
    texts[row] = ""
    pq.write_table(table.set_column(columns.index(blank), blank, pa.array(texts)), path)
    return path
