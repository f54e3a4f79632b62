"""What a job says about its input folder as it is now (issue 51): a finished job whose input changed since names
the changed file and how to run the new input, and reruns nothing; files that are not Parquet beside the part files
are named once, on stderr and in the input manifest (Spark's _SUCCESS and .crc files quietly skipped).

The runs check what a job says and writes, not its own cluster: they run on the session's LocalCluster
(`shared_cluster`, tests/jobs/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import test_cli
from typer.testing import CliRunner

from jobs.cli import app

runner = CliRunner()
gsm8k_folder = test_cli.gsm8k_folder  # the fixture: two Parquet files of real GSM8K rows (14 + 6)


def _summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


def test_a_finished_job_names_the_input_changed_since_and_runs_nothing(gsm8k_folder: Path, tmp_path: Path,
                                                                       data_dir: Path, shared_cluster: str) -> None:
    out = tmp_path / "out"
    args = ["run", str(gsm8k_folder), str(out), "--prompt-column", "question", "--max-tokens", "2", "--scheduler",
            shared_cluster, "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert not _warnings(first.stderr)
    committed = {p: p.read_bytes() for p in out.rglob("*.parquet")}
    # Upstream rewrites b.parquet with other rows and adds c.parquet.
    other = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(300, 5)
    pq.write_table(other, gsm8k_folder / "b.parquet")
    pq.write_table(other.slice(0, 2), gsm8k_folder / "c.parquet")
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    summary = _summary(again.stdout)
    assert summary["already_done"] is True and summary["rows_ok"] == 20  # the job's results, as they were
    changed = summary["inputs_changed"]
    assert len(changed) == 2 and f"{gsm8k_folder / 'b.parquet'} was " in changed[0]
    assert f"{gsm8k_folder / 'c.parquet'} is new" in changed[1]
    (warning,) = _warnings(again.stderr)
    assert "b.parquet" in warning and "c.parquet" in warning and "new OUTPUT" in warning
    assert {p: p.read_bytes() for p in out.rglob("*.parquet")} == committed  # nothing ran again


def test_files_that_are_not_parquet_are_named_once_on_stderr_and_in_the_manifest(gsm8k_folder: Path,
                                                                                   tmp_path: Path,
                                                                                   shared_cluster: str) -> None:
    (gsm8k_folder / "notes.txt").write_text("where these rows came from\n")
    (gsm8k_folder / "extra.csv").write_text("id,question\n1,what is 2 + 2?\n")
    (gsm8k_folder / "_SUCCESS").write_text("")  # what Spark leaves beside its part files: skipped without a word
    (gsm8k_folder / ".a.parquet.crc").write_bytes(b"crc")
    (gsm8k_folder / "b.parquet.crc").write_bytes(b"crc")
    out = tmp_path / "out"
    args = ["run", str(gsm8k_folder), str(out), "--prompt-column", "question", "--max-tokens", "2", "--scheduler",
            shared_cluster, "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert _summary(first.stdout)["rows_ok"] == 20
    (warning,) = _warnings(first.stderr)
    assert "extra.csv" in warning and "notes.txt" in warning and "2 files" in warning
    assert "_SUCCESS" not in warning and ".crc" not in warning
    manifest = json.loads((out / "_manifest" / "input.json").read_text())
    assert [Path(u.removeprefix("file://")) for u in manifest["skipped"]] == [gsm8k_folder / "extra.csv",
                                                                            gsm8k_folder / "notes.txt"]
    again = runner.invoke(app, args)  # said once: when the job pinned its input
    assert again.exit_code == 0 and not _warnings(again.stderr), again.output
