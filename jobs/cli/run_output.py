"""What `tokenmill run` and `tokenmill submit` print when a job ends (jobs.cli.run_commands): the summary on stdout (a
table, or one JSON object), then its warnings and notes on stderr, one line each: failed shards, no row ran, repeated
ids, re-pinned input files, files of the input folder that are not Parquet, a pinned model's note, and a finished
job's input changed since."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from jobs.cli.output import err, out, ran_in

if TYPE_CHECKING:
    from engine.worker.memory_fit import MemoryFit
    from jobs.summary import JobSummary


def print_summary(summary: JobSummary, output: str, as_json: bool, fit: MemoryFit | None = None) -> None:
    """The job's summary on stdout (a table, or one JSON object), then its warnings and notes on stderr; `fit`: the
    preflight's memory fit of this machine's workers (jobs.plan.model_fit), a row of the table / "memory" in the
    JSON."""
    if as_json:
        memory = {} if fit is None else {"memory": fit.line()}
        print(json.dumps({"event": "summary", "output": output, **summary.as_dict(), **memory}))
        _warnings_and_notes(summary)
        return
    t = Table(title=f"tokenmill run -> {output}", show_header=False)
    tpd = summary.tokens_per_dollar
    for k, v in [
        ("shards ok / failed / stopped", f"{summary.shards_ok} / {len(summary.failed)} / {len(summary.stopped)}"),
        ("rows ok / error (job)", f"{summary.rows_ok} / {summary.rows_error}"),
        ("input / output tokens (job)", f"{summary.input_tokens:,} / {summary.output_tokens:,}"),
        *([] if not summary.images else [("images (job)", f"{summary.images:,} (their tokens are input tokens)")]),
        ("this run", this_run(summary)),
        ("cost (job)", f"${summary.cost_usd:.6f} ({summary.device_s:.1f} device-seconds)"),
        *([] if summary.task != "generate" else [("tokens per dollar", "n/a" if tpd is None else f"{tpd:,.0f}")]),
        ("input tokens / rows per dollar", _per_dollar(summary.input_tokens_per_dollar, summary.rows_per_dollar)),
        ("attempts / preemptions", f"{summary.attempts} / {summary.preemptions} "
                                   f"({summary.device_s_lost:.1f} device-seconds lost)"),
        ("dtype / quantization", ran_in(summary.dtypes, summary.quantizations)),
        *([] if fit is None else [("memory (preflight)", fit.line().removeprefix("memory "))]),
    ]:
        t.add_row(k, v)
    out.print(t)
    for shard_id, error in summary.failed.items():
        err.print(f"[red]shard {shard_id} failed:[/red] {error}")
    _warnings_and_notes(summary)


def _warnings_and_notes(summary: JobSummary) -> None:
    """The summary's lines on stderr after it, one each: no row ran, repeated ids, re-pinned input files, files of
    the input folder that are not Parquet, the model's pin."""
    _warn_no_row_ran(summary)
    _warn_ids(summary)
    _note_repinned(summary)
    _warn_skipped(summary)
    _note_model(summary)


def _note_model(summary: JobSummary) -> None:
    """Say on stderr that this run pinned the model of a job started before models were pinned."""
    if summary.model_note:
        err.print(f"note: {escape(summary.model_note)}")


def this_run(summary: JobSummary) -> str:
    """What this run did itself, apart from the job's totals (rows earlier runs committed are not its work)."""
    if summary.already_done:
        return "nothing to do: the job had finished"
    if summary.task != "generate":
        rate = summary.run_rows / summary.wall_s if summary.wall_s > 0 else 0.0
        done = {"classify": "classified", "score": "scored"}.get(summary.task, "embedded")
        return f"{summary.run_rows:,} rows {done} in {summary.wall_s:.1f} s wall time ({rate:,.1f} rows/s)"
    return (f"{summary.run_rows:,} rows, {summary.run_output_tokens:,} output tokens generated in "
            f"{summary.wall_s:.1f} s wall time ({summary.output_tokens_per_s:,.1f} output tokens/s)")


def _note_repinned(summary: JobSummary) -> None:
    """Say on stderr which changed input files this run re-pinned (none of their shards had committed rows)."""
    for url in summary.repinned:
        err.print(f"note: {url} changed (or was removed) before any of its rows were committed; the job re-pinned it "
                  "as it is now (a new revision under OUTPUT/_manifest/)")


def warn_inputs_changed(summary: JobSummary, output: str) -> None:
    """One warning line when a finished job's input changed since it was pinned (summary.inputs_changed): the
    files, that nothing ran again, and how to run the new input."""
    if summary.inputs_changed:
        err.print("[yellow]warning:[/yellow] " + escape(
            f"the input changed since the job at {output} pinned it: {'; '.join(summary.inputs_changed)}. These "
            "results are of the input as it was pinned and nothing ran again; to run the new input, give a new "
            f"OUTPUT (or delete {output} and run the same command)"))


def _warn_skipped(summary: JobSummary) -> None:
    """One warning line naming the files of the input folder the job left out as not Parquet (said by the run that
    pinned the input; OUTPUT/_manifest/input.json keeps them as `skipped`)."""
    if n := len(summary.inputs_skipped):
        err.print("[yellow]warning:[/yellow] " + escape(
            f"the input folder holds {n} file{'s' if n > 1 else ''} that {'are' if n > 1 else 'is'} not Parquet, "
            f"left out of the job: {', '.join(summary.inputs_skipped)} (recorded as `skipped` in "
            f"OUTPUT/_manifest/input.json); convert {'them' if n > 1 else 'it'} to .parquet to run their rows"))


def _warn_no_row_ran(summary: JobSummary) -> None:
    """Warn on stderr when the job's committed rows are all error rows (all null, say): nothing ran."""
    if summary.rows_error and not summary.rows_ok:
        err.print(f"[yellow]warning:[/yellow] no row ran: all {summary.rows_error:,} committed rows are error rows "
                  "(the results' error column says why for each); shards with no row to run load no engine and "
                  "bill 0 device-seconds")


def _warn_ids(summary: JobSummary) -> None:
    """Warn on stderr about null and repeated ids (results tell such rows apart by input_file + input_row)."""
    if summary.ids_null or summary.ids_repeated:
        err.print(f"[yellow]warning:[/yellow] {summary.ids_repeated} result rows share their id with another row and "
                  f"{summary.ids_null} have a null id; join results to the input on input_file + input_row, or give "
                  "the input a unique id column (--id-column)")


def _per_dollar(*values: float | None) -> str:
    """Values per USD as "a / b" ("n/a" where nothing was billed)."""
    return " / ".join("n/a" if v is None else f"{v:,.0f}" for v in values)
