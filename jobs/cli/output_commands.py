"""`tokenmill export` (a job's rows in another format) and `tokenmill report` (a job's HTML page). Wire them in
with `register(app)`."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from jobs.errors import EXIT_FAILED_SHARDS, JobError

FORMATS = ("openai-batch",)


def _fail(e: Exception, code: int = 2) -> typer.Exit:
    print(f"error: {e}", file=sys.stderr)
    return typer.Exit(code)


def _refuse_rows(output: str, command: str, tasks: tuple[str, ...]) -> None:
    """Exit 2, one line, when OUTPUT holds the rows of a job of one of `tasks` (a committed results file with its
    column: classify's `label`, score's `score`), which `tokenmill COMMAND` does not read: `export` writes completions
    and embeddings only (the OpenAI batch format has no classification or score response); `report` reads every
    task's rows and refuses none."""
    from pipeline.storage import list_folder, read_fs

    fs, root = read_fs(output)
    try:
        files = [f["name"] for f in list_folder(fs, f"{root.rstrip('/')}/results") if f["name"].endswith(".parquet")]
    except OSError:
        return  # no results yet: the command itself says what OUTPUT holds
    if files:
        import pyarrow.parquet as pq

        from pipeline.row_kinds import results_task

        with fs.open(files[0], "rb") as f:
            task = results_task(pq.read_schema(f).names)
        if task in tasks:
            raise _fail(JobError(f"{output} holds a {task} job's rows (--task {task}): `tokenmill {command}` "
                                 f"does not read them; read its results/*.parquet (the "
                                 f"{'label' if task == 'classify' else task} column) directly"))


def export(
    output: Annotated[str, typer.Argument(help="The job's OUTPUT folder or fsspec URL.")],
    format: Annotated[str, typer.Option(help="openai-batch: the OpenAI Batch API output format (JSONL: id, "
                                             "custom_id, response {status_code, request_id, body}, error); an "
                                             "embed job's as /v1/embeddings responses.")
                      ] = "openai-batch",
    to: Annotated[str, typer.Option("--to", "-o", help="File or fsspec URL to write; - = stdout.")] = "-",
) -> None:
    """Write the job's rows at OUTPUT in another format, in input order: one line per committed row.

    Example: tokenmill export out/ --format openai-batch --to batch_output.jsonl

    Exit codes: 0 every row written, 1 some shards have no committed results yet (their rows are missing; the
    shard ids go to stderr), 2 no job at OUTPUT or an unknown format.
    """
    if format not in FORMATS:
        raise _fail(ValueError(f"unknown --format {format!r}; choose one of {', '.join(FORMATS)}"))
    from jobs.formats.openai_batch_export import export_openai_batch  # pyarrow and the pipeline: only when it runs

    _refuse_rows(output, "export", ("classify", "score"))

    try:
        if to == "-":
            counts = export_openai_batch(output, sys.stdout)
        else:
            import fsspec

            with fsspec.open(to, "wt", encoding="utf-8") as dest:
                counts = export_openai_batch(output, dest)
    except JobError as e:
        raise _fail(e, e.exit_code) from e
    print(f"exported {counts.responses} responses and {counts.errors} errors from {output} to {to}",
          file=sys.stderr)
    if counts.missing_shards:
        print(f"shards without committed results (their rows are missing): {', '.join(counts.missing_shards)}; "
              "finish the job (tokenmill status) and export again", file=sys.stderr)
        raise typer.Exit(EXIT_FAILED_SHARDS)


def report(
    output: Annotated[str, typer.Argument(help="The job's OUTPUT folder or fsspec URL.")],
    html: Annotated[str, typer.Option(help="The page to write: a file or fsspec URL.")] = "report.html",
) -> None:
    """Write one self-contained HTML page of the job at OUTPUT (plots embedded): totals, output tokens/s over time,
    tokens per dollar per shard, attempts and preemptions per shard with the device-seconds lost, error rows by
    reason, latency spread per shard. Works on a running or partial job too (what is committed so far).

    Example: tokenmill report out/ --html report.html

    Exit codes: 0 written, 2 no job at OUTPUT.
    """
    from jobs.formats.report import render_report  # matplotlib: only for this command

    try:
        page = render_report(output)
    except JobError as e:
        raise _fail(e, e.exit_code) from e
    import fsspec

    with fsspec.open(html, "wt", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote the report of {output} to {html}", file=sys.stderr)


def register(app: typer.Typer) -> None:
    """Add the `export` and `report` commands to `app`."""
    app.command()(export)
    app.command()(report)
