"""`tokenmill run` and `tokenmill submit`: build a job spec, run it with progress on stderr, print its summary (or,
with --dry-run, its forecast). Wire them in with `register(app)`.

The job's machinery (jobs.spec: Dask, the engine, torch) is imported when a command runs, not when the CLI starts.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from jobs.cli.options import job_options, options_given, options_set_by_env
from jobs.cli.output import err, exit_on_failure, fail, out
from jobs.cli.run_output import print_summary, warn_inputs_changed
from jobs.errors import EXIT_CANCELLED, EXIT_FAILED_SHARDS, JobError
from schemas.job_spec import OPTIONS, JobSpec, JobSpecError, load_job_spec

if TYPE_CHECKING:
    from rich.progress import Progress

    from engine.worker.memory_fit import MemoryFit


class Reporter:
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
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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


def _input_tokens(fc: Any) -> str:
    """The forecast's input tokens: exact when every row was tokenized, else an estimate with its sample size."""
    if fc.input_tokens_exact:
        return f"{fc.input_tokens:,}"
    return f"~{fc.input_tokens:,} (estimated from the {fc.input_rows_sampled:,} rows of the first shard)"


def _per_dollar_row(fc: Any) -> tuple[str, str]:
    """The forecast table's per-dollar row: output tokens per USD, or an embed, classify or score job's input tokens and
    rows per USD (it generates none)."""
    def usd(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.0f}"

    if fc.task == "generate":
        return "tokens per dollar", usd(fc.tokens_per_dollar)
    return "input tokens / rows per dollar", f"{usd(fc.input_tokens_per_dollar)} / {usd(fc.rows_per_dollar)}"


def _print_forecast(spec: JobSpec, as_json: bool, set_by: dict[str, str] | None = None,
                    fit: MemoryFit | None = None) -> None:
    """Forecast the job (jobs.plan.forecast) and print it: a table, or one JSON line; `fit` (the preflight's memory
    numbers, jobs.plan.model_fit) in both."""
    from jobs.interrupt import run_or_exit_on_signal
    from jobs.plan.forecast import forecast_job  # loads torch and the engine: only for --dry-run
    from jobs.plan.forecast_pooling import forecast_pooling_job

    def interrupted(name: str) -> None:
        err.print(f"interrupted by {name}: the dry run stopped; it wrote nothing")

    with exit_on_failure(spec.output, set_by):
        fc = run_or_exit_on_signal(lambda: (forecast_job if spec.task == "generate" else forecast_pooling_job)(spec),
                                   interrupted)
    if as_json:
        memory = {} if fit is None else {"memory": fit.as_dict()}
        print(json.dumps({"event": "forecast", "output": spec.output, **fc.as_dict(), **memory}))
        return
    t = Table(title=f"tokenmill forecast (dry run, nothing written) -> {spec.output}", show_header=False)
    for k, v in ([("rows / shards", f"{fc.rows:,} / {fc.shards}"), ("input tokens", _input_tokens(fc))]
                 + ([("images / their tokens", f"{fc.images:,} / {fc.image_tokens:,} (in the input tokens; counted "
                                               "by the model's processor from the images' sizes)")]
                    if fc.images else [])
                 + ([("output tokens expected (max)", f"{fc.output_tokens:,} ({fc.output_tokens_max:,})")]
                    if fc.task == "generate" else [])
                 + [("device-hours", f"{fc.device_hours:.4f} ({fc.device_s:,.1f} device-seconds on {fc.device}, "
                                  f"{fc.dtype})"),
                 ("quantization", fc.quantization),
                 ("cost", f"${fc.cost_usd:.6f} at ${fc.price_per_hour_usd}/hour"),
                 _per_dollar_row(fc),
                 ("calibration", f"{fc.sample_rows} rows, {fc.prefill_tokens_per_s:,.0f} "
                                 + (f"prefill tok/s, {fc.mean_output_tokens_observed:.1f} output tokens per row, "
                                    if fc.task == "generate" else f"input tok/s ({fc.task}, the encoder's forward), ")
                                 + f"{fc.calibration_s:.1f} s; device time +/- {fc.uncertainty:.0%}, wall "
                                 f"x{fc.load_stretch:.2f} of it (other load: a job beside it takes about that much "
                                 "longer)" if fc.sample_rows else "none: no engine loaded")]
                + ([("note", fc.note)] if fc.note else [])):
        t.add_row(k, v)
    if fit is not None:
        gib = 1 << 30
        t.add_row("model on the device", f"{fit.model_bytes / gib:.2f} GiB of {fit.memory_bytes / gib:.2f} GiB "
                                         f"usable on {fit.device}")
        t.add_row("KV cache", f"{fit.kv_bytes_per_token / 1024:.1f} KiB per token; pool {fit.kv_pool_bytes / gib:.2f}"
                              f" GiB = {fit.pool_tokens:,} tokens = {fit.sequences:,} sequences of --max-model-len "
                              f"{fit.max_model_len:,} at once")
    if fc.kv_rows_at_once:
        t.add_row("rows at once", f"{fc.kv_rows_at_once:,} rows of this job's mean length (prompt"
                                  f"{' with its image tokens' if fc.images else ''}, expected output) fit in the KV "
                                  "cache of the engine loaded here")
    out.print(t)


def _execute(spec: JobSpec, resume: bool, as_json: bool, metrics_file: str | None = None,
             dry_run: bool = False, set_by: dict[str, str] | None = None) -> None:
    """Run a spec with progress on stderr and the summary on stdout; exit with the job's code. `dry_run`: print
    the job's forecast instead and write nothing. `set_by`: the options whose values came from environment
    variables (jobs.cli.options.options_set_by_env), named in errors."""
    from jobs.interrupt import ClientInterrupt
    from jobs.spec import checked_spec, run_spec, spec_fit  # Dask, the engine, torch: only when a job runs

    try:
        spec = checked_spec(spec)  # absolute OUTPUT (printed below as workers see it), model and OUTPUT checked
        fit = spec_fit(spec, spec.model)
    except JobError as e:
        raise fail(e, e.exit_code, set_by) from e
    if dry_run:
        return _print_forecast(spec, as_json, set_by, fit)
    reporter = Reporter()
    interrupt = ClientInterrupt(spec.output)
    with exit_on_failure(spec.output, set_by, on_error=reporter.stop):
        try:
            with interrupt:
                summary = run_spec(spec, resume=resume, on_start=reporter.start, on_progress=reporter.update,
                                   metrics_file=metrics_file)
        except (JobError, KeyboardInterrupt) as e:
            if interrupt.signum is None:
                raise  # a JobError: its line (exit_on_failure)
            reporter.stop()
            interrupt.lift()
            err.print(f"interrupted by {interrupt.name}: stopped before the job finished; what is committed under "
                      f"{spec.output} stays (`tokenmill status {spec.output}`). Run the same command again to resume")
            raise typer.Exit(interrupt.exit_code) from e
    reporter.stop()
    if summary.already_done:
        err.print(f"the job at {spec.output} has already finished (_SUCCESS is committed); nothing to do")
        warn_inputs_changed(summary, spec.output)
    print_summary(summary, spec.output, as_json, fit)
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
        raise fail(e) from e
    _execute(spec, resume, json_summary, metrics_file, dry_run, set_by)


# The job options with an environment variable (TOKENMILL_DEVICE, ...): `submit` takes them as `run` does, over the
# spec's values (as DASK_SCHEDULER_ADDRESS overrides cluster.scheduler); --scheduler and --output are its own.
_SUBMIT_OVERRIDES = tuple(name for name, o in OPTIONS.items() if o.cli.envvar and name not in ("scheduler", "output"))


@job_options(only=_SUBMIT_OVERRIDES)
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
    **options: Any,
) -> None:
    """Run the job a YAML spec describes, and wait for it. Idempotent: a finished job is a no-op (exit 0), a
    partial one resumes where it stopped, a running one is left alone (exit 3). This process drives the job: keep
    it alive until it exits (on Kubernetes, a Job or CronJob pod); a rerun picks up where it stopped. The engine
    options below (or their TOKENMILL_* environment variables), when given, override the spec's values.

    Example: tokenmill submit infra/job.example.yaml --scheduler tcp://dask-scheduler:8786
    """
    try:
        spec = load_job_spec(job)
    except JobSpecError as e:
        raise fail(e) from e
    overrides = {k: v for k, v in (("scheduler", scheduler), ("output", output)) if v}
    overrides |= {name: options[name] for name in sorted(options_given(ctx, frozenset(options)))}
    set_by = options_set_by_env(ctx)
    if overrides:
        given = ", ".join(set_by.get(k) or f"--{k.replace('_', '-')}" for k in overrides)
        try:
            spec = spec.replace(f"job spec {job!r} with {given}", set_by, **overrides)
        except JobSpecError as e:
            raise fail(e) from e
    _execute(spec, resume, json_summary, metrics_file, dry_run, set_by)


def register(app: typer.Typer) -> None:
    """Add the `run` and `submit` commands to `app`."""
    app.command()(run)
    app.command()(submit)
