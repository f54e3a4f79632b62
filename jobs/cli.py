"""`tokenmill`: the command line. Thin Typer commands that build a config, call the core, map JobError to exit codes."""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jobs import model_commands, output_commands
from jobs.control import JobStatus, cancel_job, job_status
from jobs.errors import EXIT_CANCELLED, EXIT_FAILED_SHARDS, JobError, storage_error
from jobs.interrupt import ClientInterrupt, run_or_exit_on_signal
from jobs.options import job_options, options_set_by_env
from jobs.preflight import check_store
from jobs.spec import checked_spec, run_spec
from jobs.summary import JobSummary
from schemas.job_spec import OPTIONS, JobSpec, JobSpecError, job_spec_json_schema, load_job_spec

_EXIT_CODES = ("Exit codes: 0 done (or nothing left to do), 1 some shards failed, 2 bad input, options or spec "
               "(nothing ran), 3 another run holds the job, 4 the job was cancelled (use --resume), 5 `status`: "
               "unfinished and no run holds it, 6 no space left on OUTPUT's device (free space and run again), "
               "129 / 130 / 143 interrupted by SIGHUP / SIGINT / SIGTERM (committed rows kept; run again to resume).")

app = typer.Typer(
    help="tokenmill: offline batch LLM inference. Parquet prompts in, completions and a tokens-per-dollar bill out. "
         + _EXIT_CODES,
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
err = Console(stderr=True, soft_wrap=True)  # an error line stays one line in logs (no wrap at 80 columns)
out = Console()


class _Reporter:
    """Progress on stderr: a rich bar on a terminal, a JSON line every few seconds otherwise (logs, Airflow)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.rows = self.tokens = 0
        self.total = 0
        self.t0 = time.perf_counter()
        self.last_line = 0.0
        self.printed: tuple[int, int] = (0, 0)
        self.bar: Progress | None = None
        self.task = None

    def start(self, total_rows: int) -> None:
        self.total, self.t0 = total_rows, time.perf_counter()
        if self.tty:
            self.bar = Progress(TextColumn("rows"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[rate]}"), console=err, transient=False)
            self.bar.start()
            self.task = self.bar.add_task("rows", total=total_rows, rate="")
        else:
            print(json.dumps({"event": "start", "rows_total": total_rows}), file=sys.stderr, flush=True)

    def update(self, rows: int, tokens: int) -> None:
        self.rows += rows
        self.tokens += tokens
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=self.rows, rate=f"{self._rate():,.1f} out tok/s")
        elif time.perf_counter() - self.last_line >= 5.0 or self.rows >= self.total:
            self._line()

    def _rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def _line(self) -> None:
        self.last_line = time.perf_counter()
        self.printed = (self.rows, self.tokens)
        print(json.dumps({"event": "progress", "rows_done": self.rows, "rows_total": self.total,
                          "output_tokens": self.tokens, "output_tokens_per_s": round(self._rate(), 2)}),
              file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.total and self.printed != (self.rows, self.tokens):
            self._line()  # the last state, so log readers see where the job ended


def _ran_in(dtypes: list[str], quantizations: list[str]) -> str:
    """"bfloat16 / none": what the committed shards ran in; every distinct value when shards differ."""
    return f"{', '.join(dtypes) or 'n/a'} / {', '.join(quantizations) or 'n/a'}"


def _print_summary(summary: JobSummary, output: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"event": "summary", "output": output, **summary.as_dict()}))
        _warn_ids(summary)
        _note_repinned(summary)
        _note_model(summary)
        return
    t = Table(title=f"tokenmill run -> {output}", show_header=False)
    tpd = summary.tokens_per_dollar
    for k, v in [
        ("shards ok / failed / stopped", f"{summary.shards_ok} / {len(summary.failed)} / {len(summary.stopped)}"),
        ("rows ok / error (job)", f"{summary.rows_ok} / {summary.rows_error}"),
        ("input / output tokens (job)", f"{summary.input_tokens:,} / {summary.output_tokens:,}"),
        ("this run", _this_run(summary)),
        ("cost (job)", f"${summary.cost_usd:.6f} ({summary.device_s:.1f} device-seconds)"),
        ("tokens per dollar", "n/a" if tpd is None else f"{tpd:,.0f}"),
        ("attempts / preemptions", f"{summary.attempts} / {summary.preemptions} "
                                   f"({summary.gpu_s_lost:.1f} device-seconds lost)"),
        ("dtype / quantization", _ran_in(summary.dtypes, summary.quantizations)),
    ]:
        t.add_row(k, v)
    out.print(t)
    for shard_id, error in summary.failed.items():
        err.print(f"[red]shard {shard_id} failed:[/red] {error}")
    _warn_ids(summary)
    _note_repinned(summary)
    _note_model(summary)


def _note_model(summary: JobSummary) -> None:
    """Say on stderr that this run pinned the model of a job started before models were pinned."""
    if summary.model_note:
        err.print(f"note: {escape(summary.model_note)}")


def _this_run(summary: JobSummary) -> str:
    """What this run did itself, apart from the job's totals (rows earlier runs committed are not its work)."""
    if summary.already_done:
        return "nothing to do: the job had finished"
    return (f"{summary.run_rows:,} rows, {summary.run_output_tokens:,} output tokens generated in "
            f"{summary.wall_s:.1f} s wall time ({summary.output_tokens_per_s:,.1f} output tokens/s)")


def _note_repinned(summary: JobSummary) -> None:
    """Say on stderr which changed input files this run re-pinned (none of their shards had committed rows)."""
    for url in summary.repinned:
        err.print(f"note: {url} changed (or was removed) before any of its rows were committed; the job re-pinned it "
                  "as it is now (a new revision under OUTPUT/_manifest/)")


def _warn_ids(summary: JobSummary) -> None:
    """Warn on stderr about null and repeated ids (results tell such rows apart by input_file + input_row)."""
    if summary.ids_null or summary.ids_repeated:
        err.print(f"[yellow]warning:[/yellow] {summary.ids_repeated} result rows share their id with another row and "
                  f"{summary.ids_null} have a null id; join results to the input on input_file + input_row, or give "
                  "the input a unique id column (--id-column)")


def _fail(e: Exception, code: int = 2, set_by: dict[str, str] | None = None) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(_name_env_vars(str(e), set_by or {}))}")
    return typer.Exit(code)


def _storage_fail(e: Exception, output: str) -> typer.Exit | None:
    """One line and its exit code for a storage failure (jobs.errors.storage_error); None for other errors."""
    failure = storage_error(e, output)
    return None if failure is None else _fail(failure, failure.exit_code)


def _name_env_vars(message: str, set_by: dict[str, str]) -> str:
    """`message` with a note for each option it names (--device) whose value came from an environment variable
    (`set_by`: option name -> variable) that the message does not name yet: the user must find what to fix."""
    for name, envvar in set_by.items():
        flag = "--" + name.replace("_", "-")
        if envvar not in message and re.search(rf"{re.escape(flag)}(?![\w-])", message):
            message += f" ({flag} was set by the environment variable {envvar}: fix or unset it)"
    return message


def _print_forecast(spec: JobSpec, as_json: bool, set_by: dict[str, str] | None = None) -> None:
    """Forecast the job (jobs.forecast) and print it: a table, or one JSON line."""
    from jobs.forecast import forecast_job  # loads torch and the engine: only for --dry-run

    def interrupted(name: str) -> None:
        err.print(f"interrupted by {name}: the dry run stopped; it wrote nothing")

    try:
        fc = run_or_exit_on_signal(lambda: forecast_job(spec), interrupted)
    except JobError as e:
        raise _fail(e, e.exit_code, set_by) from e
    except Exception as e:
        if (failure := _storage_fail(e, spec.output)) is None:
            raise
        raise failure from e
    if as_json:
        print(json.dumps({"event": "forecast", "output": spec.output, **fc.as_dict()}))
        return
    t = Table(title=f"tokenmill forecast (dry run, nothing written) -> {spec.output}", show_header=False)
    tpd = fc.tokens_per_dollar
    for k, v in [("rows / shards", f"{fc.rows:,} / {fc.shards}"), ("input tokens", f"{fc.input_tokens:,}"),
                 ("output tokens expected (max)", f"{fc.output_tokens:,} ({fc.output_tokens_max:,})"),
                 ("device-hours", f"{fc.device_hours:.4f} ({fc.device_s:,.1f} device-seconds on {fc.device}, "
                                  f"{fc.dtype})"),
                 ("cost", f"${fc.cost_usd:.6f} at ${fc.price_per_hour_usd}/hour"),
                 ("tokens per dollar", "n/a" if tpd is None else f"{tpd:,.0f}"),
                 ("calibration", f"{fc.sample_rows} rows, {fc.prefill_tokens_per_s:,.0f} prefill tok/s, "
                                 f"{fc.mean_output_tokens_observed:.1f} output tokens per row, "
                                 f"{fc.calibration_s:.1f} s")]:
        t.add_row(k, v)
    out.print(t)


def _execute(spec: JobSpec, resume: bool, as_json: bool, metrics_file: str | None = None,
             dry_run: bool = False, set_by: dict[str, str] | None = None) -> None:
    """Run a spec with progress on stderr and the summary on stdout; exit with the job's code. `dry_run`: print
    the job's forecast instead and write nothing. `set_by`: the options whose values came from environment
    variables (jobs.options.options_set_by_env), named in errors."""
    try:
        spec = checked_spec(spec)  # absolute OUTPUT (printed below as workers see it), model and OUTPUT checked
    except JobError as e:
        raise _fail(e, e.exit_code, set_by) from e
    if dry_run:
        return _print_forecast(spec, as_json, set_by)
    reporter = _Reporter()
    interrupt = ClientInterrupt(spec.output)
    try:
        with interrupt:
            summary = run_spec(spec, resume=resume, on_start=reporter.start, on_progress=reporter.update,
                               metrics_file=metrics_file)
    except (JobError, KeyboardInterrupt) as e:
        reporter.stop()
        if interrupt.signum is None:
            raise _fail(e, getattr(e, "exit_code", 2), set_by) from e
        interrupt.lift()
        err.print(f"interrupted by {interrupt.name}: stopped before the job finished; what is committed under "
                  f"{spec.output} stays (`tokenmill status {spec.output}`). Run the same command again to resume")
        raise typer.Exit(interrupt.exit_code) from e
    except Exception as e:
        reporter.stop()
        if (failure := _storage_fail(e, spec.output)) is None:
            raise
        raise failure from e
    reporter.stop()
    if summary.already_done:
        err.print(f"the job at {spec.output} has already finished (_SUCCESS is committed); nothing to do")
    _print_summary(summary, spec.output, as_json)
    if interrupt.signum is not None and (summary.stopped or summary.cancelled):
        interrupt.lift()
        err.print(f"interrupted by {interrupt.name}: the running shards committed their finished rows and stopped "
                  f"({summary.rows_ok + summary.rows_error} rows in finished shards, {len(summary.stopped)} shards "
                  f"unfinished); the lease is released. Run the same command again to resume")
        raise typer.Exit(interrupt.exit_code)
    if summary.failed:
        raise typer.Exit(EXIT_FAILED_SHARDS)
    if summary.cancelled:
        err.print(f"the job was cancelled; {len(summary.stopped)} shards are unfinished. Resume it with --resume")
        raise typer.Exit(EXIT_CANCELLED)


_METRICS_HELP = ("Write the job's Prometheus metrics to this node_exporter textfile (*.prom) as the run goes. "
                 "TOKENMILL_PUSHGATEWAY_URL pushes them to a Pushgateway.")
_DRY_RUN_HELP = ("Print what the job will cost (rows, tokens, device-hours, USD at --price-per-hour) from its input "
                 "and a short calibration of the engine here, and write nothing.")
# What the dask-kubernetes operator sets in the pods it starts; `--scheduler` wins over it.
SCHEDULER_ENV = OPTIONS["scheduler"].cli.envvar
_RESUME_HELP = "Go on with a job that was cancelled (`tokenmill cancel`); without it such a job is refused (exit 4)."


@app.command()
@job_options()
def run(
    ctx: typer.Context,
    input: Annotated[str, typer.Argument(help=OPTIONS["input"].field.description)],
    output: Annotated[str, typer.Argument(help=OPTIONS["output"].field.description)],
    resume: Annotated[bool, typer.Option("--resume", help=_RESUME_HELP)] = False,
    json_summary: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON line.")] = False,
    metrics_file: Annotated[str | None, typer.Option(help=_METRICS_HELP)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help=_DRY_RUN_HELP)] = False,
    **options: Any,
) -> None:
    """Generate a completion for every row of INPUT and write results and accounting under OUTPUT. The job spec
    options are the fields of a `tokenmill submit` YAML spec, flattened (sampling.max_tokens is --max-tokens).

    Example: tokenmill run ../shared/data/gsm8k_test.parquet out/ --prompt-column question --limit 64
    """
    set_by = options_set_by_env(ctx)
    try:
        spec = JobSpec.from_options("tokenmill run options", set_by, input=input, output=output, **options)
    except JobSpecError as e:
        raise _fail(e) from e
    _execute(spec, resume, json_summary, metrics_file, dry_run, set_by)


@app.command()
def submit(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job spec YAML (see infra/job.example.yaml), a path or fsspec URL.")],
    scheduler: Annotated[str | None, typer.Option(help="Dask scheduler address (tcp://host:8786); overrides the "
                                                       "spec's cluster.scheduler. Default: the spec's, else an "
                                                       "embedded LocalCluster.", envvar=SCHEDULER_ENV)] = None,
    output: Annotated[str | None, typer.Option(help="OUTPUT instead of the spec's output, e.g. one per day from "
                                                    "a scheduler: s3://bucket/jobs/nightly/20260101/.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help=_RESUME_HELP)] = False,
    json_summary: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON line.")] = False,
    metrics_file: Annotated[str | None, typer.Option(help=_METRICS_HELP)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help=_DRY_RUN_HELP)] = False,
) -> None:
    """Run the job a YAML spec describes, and wait for it. Idempotent: a finished job is a no-op (exit 0), a
    partial one resumes where it stopped, a running one is left alone (exit 3). This process drives the job: keep
    it alive until it exits (on Kubernetes, a Job or CronJob pod); a rerun picks up where it stopped.

    Example: tokenmill submit infra/job.example.yaml --scheduler tcp://dask-scheduler:8786
    """
    try:
        spec = load_job_spec(job)
    except JobSpecError as e:
        raise _fail(e) from e
    overrides = {k: v for k, v in (("scheduler", scheduler), ("output", output)) if v}
    set_by = options_set_by_env(ctx)
    if overrides:
        try:
            spec = spec.replace(f"job spec {job!r} with {', '.join(f'--{k}' for k in overrides)}", set_by,
                                **overrides)
        except JobSpecError as e:
            raise _fail(e) from e
    _execute(spec, resume, json_summary, metrics_file, dry_run, set_by)


def _print_status(st: JobStatus) -> None:
    t = Table(title=f"tokenmill status {st.output}: {st.state}", show_header=False)
    tpd = st.tokens_per_dollar
    for k, v in [
        ("input", f"{st.input} (pinned {st.started_at})"),
        ("model", "not pinned (a job started before models were pinned; the next run pins it)" if st.model is None
         else f"{st.model['resolved']} ({st.model['fingerprint']}, pinned {st.model['pinned_at']})"),
        ("shards", ", ".join(f"{n} {state}" for state, n in st.shards.items())),
        ("rows committed", f"{st.rows_committed:,} / {st.rows:,}"),
        ("input / output tokens", f"{st.input_tokens:,} / {st.output_tokens:,}"),
        ("cost", f"${st.cost_usd:.6f}"),
        ("tokens per dollar", "n/a" if tpd is None else f"{tpd:,.0f}"),
        ("attempts / preemptions", f"{st.attempts} / {st.preemptions} ({st.gpu_s_lost:.1f} device-seconds lost)"),
        ("dtype / quantization", _ran_in(st.dtypes, st.quantizations)),
        ("run", "none" if st.lease is None else f"{st.lease['holder']} (lease for {st.lease['expires_in_s']} s)"),
    ]:
        t.add_row(k, v)
    if st.cancelled is not None:
        t.add_row("cancelled", str(st.cancelled.get("cancelled_at", "yes")))
    out.print(t)
    for shard_id, error in st.failed.items():
        err.print(f"[red]shard {shard_id} failed:[/red] {error}")


@app.command()
def status(
    output: Annotated[str, typer.Argument(help="The job's OUTPUT folder or fsspec URL.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as one JSON line.")] = False,
) -> None:
    """Shards done / running / partial / failed / pending, rows, tokens, cost, tokens per dollar and attempts of the
    job at OUTPUT, from what is committed there.

    Exit codes: 0 done, 1 failed shards (no run holds the job), 2 no job at OUTPUT, 3 a run holds the job (running),
    4 cancelled, 5 unfinished and no run holds it (submit it again to resume).
    """
    try:
        check_store(output, "OUTPUT")  # an endpoint where nothing listens: one line in seconds, not botocore's retries
        st = job_status(output)
    except JobError as e:
        raise _fail(e, e.exit_code) from e
    except Exception as e:
        if (failure := _storage_fail(e, output)) is None:
            raise
        raise failure from e
    if as_json:
        print(json.dumps(st.as_dict()))
    else:
        _print_status(st)
    raise typer.Exit(st.exit_code)


@app.command()
def cancel(
    output: Annotated[str, typer.Argument(help="The job's OUTPUT folder or fsspec URL.")],
    reason: Annotated[str | None, typer.Option(help="Why, recorded in the cancel marker.")] = None,
) -> None:
    """Cancel the job at OUTPUT: commits OUTPUT/_CANCEL. Running shards stop at their next poll (every
    TOKENMILL_STOP_POLL_S seconds, default 5) and commit what they finished; queued shards do not start. A later
    run or submit refuses the job (exit 4) unless --resume. Exit 0, or 2 when no job ever started at OUTPUT.
    """
    try:
        check_store(output, "OUTPUT")  # an endpoint where nothing listens: one line in seconds, not botocore's retries
        message = cancel_job(output, reason)
    except JobError as e:
        raise _fail(e, e.exit_code) from e
    except Exception as e:
        if (failure := _storage_fail(e, output)) is None:
            raise
        raise failure from e
    err.print(message)


@app.command("job-schema")
def job_schema() -> None:
    """Print the JSON Schema (draft 2020-12) of a job spec file, generated from the spec model: point an editor's
    YAML language server at it, or check specs with it in CI. The same file ships as schemas/job_spec.schema.json."""
    print(json.dumps(job_spec_json_schema(), indent=2))


@app.command()
def doctor(as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False
           ) -> None:
    """What this machine is (CPU model and features, cores, memory, GPUs, versions, which kernels build and run) and
    what the engine's defaults pick on it (device, dtype, attention) and why. Paste it into a bug report. The first
    run on a machine builds the C++ kernels (about 15 s)."""
    from jobs.doctor import machine_report

    report = machine_report()
    if as_json:
        print(json.dumps(report))
        return
    table = Table(show_header=False, box=None)
    for section, values in report.items():
        if isinstance(values, dict):
            for key, value in values.items():
                shown = ", ".join(value) if isinstance(value, list) else value
                table.add_row(f"[bold]{section}[/bold]" if key == next(iter(values)) else "", key, escape(str(shown)))
        else:
            table.add_row(f"[bold]{section}[/bold]", "", escape(", ".join(f"{g['name']} ({g['memory_gib']} GiB)"
                                                                          for g in values) or "none"))
    Console().print(table)


@app.command()
def version() -> None:
    """Print tokenmill's version."""
    from importlib.metadata import version as dist_version

    print(dist_version("tokenmill"))


model_commands.register(app)
output_commands.register(app)

if __name__ == "__main__":
    app()
