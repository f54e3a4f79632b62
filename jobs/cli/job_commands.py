"""`tokenmill status` and `tokenmill cancel`: a job's state from what is committed under OUTPUT, and its cancel
marker. Wire them in with `register(app)`. Neither imports torch nor Dask (tests/jobs/test_cli_imports.py).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from jobs.cli.output import err, exit_on_failure, out, ran_in

if TYPE_CHECKING:
    from jobs.control import JobStatus


def _print_status(st: JobStatus) -> None:
    """The status as a table on stdout (failed shards and an unsealed job's note on stderr)."""
    t = Table(title=f"tokenmill status {st.output}: {st.state}", show_header=False)
    def usd(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.0f}"

    for k, v in [
        ("input", f"{st.input} (pinned {st.started_at})"),
        ("model", "not pinned (a job started before models were pinned; the next run pins it)" if st.model is None
         else f"{st.model['resolved']} ({st.model['fingerprint']}, pinned {st.model['pinned_at']})"),
        ("shards", ", ".join(f"{n} {state}" for state, n in st.shards.items())),
        ("rows committed", f"{st.rows_committed:,} / {st.rows:,}"),
        ("input / output tokens", f"{st.input_tokens:,} / {st.output_tokens:,}"),
        ("cost", f"${st.cost_usd:.6f}"),
        # Output tokens per USD: a generate job's measure (and a job whose task no done shard shows yet); input
        # tokens and rows per USD: an embed, classify or score job's, shown for every job (the --json has all three).
        *([("tokens per dollar", usd(st.tokens_per_dollar))] if st.task in ("generate", None) else []),
        ("input tokens / rows per dollar", f"{usd(st.input_tokens_per_dollar)} / {usd(st.rows_per_dollar)}"),
        ("attempts / preemptions", f"{st.attempts} / {st.preemptions} ({st.device_s_lost:.1f} device-seconds lost)"),
        ("unfinished shards' attempts", f"{st.device_s_unfinished:.1f} device-seconds so far (a failed shard's "
                                        "in the cost; the others' billed when they finish)"),
        ("dtype / quantization", ran_in(st.dtypes, st.quantizations)),
        ("run", "none" if st.lease is None else f"{st.lease['holder']} (lease for {st.lease['expires_in_s']} s)"),
    ]:
        t.add_row(k, v)
    if st.cancelled is not None:
        t.add_row("cancelled", str(st.cancelled.get("cancelled_at", "yes")))
    out.print(t)
    for shard_id, error in st.failed.items():
        err.print(f"[red]shard {shard_id} failed:[/red] {error}")
    if st.state == "unsealed":
        err.print("complete, not sealed: every shard is committed but OUTPUT/_SUCCESS is not (a run stopped before "
                  "sealing the job); run the same command to seal it")


def status(
    output: Annotated[str, typer.Argument(help="The job's OUTPUT folder or fsspec URL.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as one JSON line.")] = False,
) -> None:
    """Shards done / running / partial / failed / pending, rows, tokens, cost, tokens per dollar and attempts of the
    job at OUTPUT, from what is committed there.

    Exit codes: 0 done (OUTPUT/_SUCCESS committed), 1 failed shards (no run holds the job), 2 no job at OUTPUT, 3 a
    run holds the job (running), 4 cancelled, 5 unfinished or not sealed (every shard committed, no _SUCCESS) and
    no run holds it (run the same command again to resume or seal it).
    """
    from jobs.control import job_status
    from jobs.plan.preflight import check_store

    with exit_on_failure(output):
        check_store(output, "OUTPUT")  # an endpoint where nothing listens: one line in seconds, not botocore's retries
        st = job_status(output)
    if as_json:
        print(json.dumps(st.as_dict()))
    else:
        _print_status(st)
    raise typer.Exit(st.exit_code)


def cancel(
    output: Annotated[str, typer.Argument(help="The job's OUTPUT folder or fsspec URL.")],
    reason: Annotated[str | None, typer.Option(help="Why, recorded in the cancel marker.")] = None,
) -> None:
    """Cancel the job at OUTPUT: commits OUTPUT/_CANCEL. Running shards stop at their next poll (every
    TOKENMILL_STOP_POLL_S seconds, default 5) and commit what they finished; queued shards do not start. A later
    run or submit refuses the job (exit 4) unless --resume. Exit 0, or 2 when no job ever started at OUTPUT.
    """
    from jobs.control import cancel_job
    from jobs.plan.preflight import check_store

    with exit_on_failure(output):
        check_store(output, "OUTPUT")  # an endpoint where nothing listens: one line in seconds, not botocore's retries
        message = cancel_job(output, reason)
    err.print(message)


def register(app: typer.Typer) -> None:
    """Add the `status` and `cancel` commands to `app`."""
    app.command()(status)
    app.command()(cancel)
