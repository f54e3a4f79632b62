"""`tokenmill`: the command line. Thin Typer commands that build a config, call the core, map JobError to exit codes.

Commands live in jobs.run_commands (run, submit), jobs.model_commands (quantize, perplexity), jobs.output_commands
(export, report) and here (status, cancel, job-schema, doctor, version). NOTE: each command imports what it needs
when it runs, so `tokenmill --help` loads neither torch nor Dask, and `status` / `cancel` no torch
(tests/jobs/test_cli_imports.py). The commands whose options are generated from the job spec (run, submit,
perplexity; jobs.options) and quantize are built only when they run or show their own help (_LazyGroup): the spec
model (pydantic) is about a third of `tokenmill --help`'s time, and `--help`, `status` and `cancel` do not need it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from jobs import output_commands
from jobs.cli_output import err, exit_on_failure, internal_error, out, ran_in
from jobs.process_env import set_omp_wait_policy

if TYPE_CHECKING:
    from jobs.control import JobStatus

_EXIT_CODES = ("Exit codes: 0 done (or nothing left to do), 1 some shards failed, 2 bad input, options or spec "
               "(nothing ran), 3 another run holds the job, 4 the job was cancelled (use --resume), 5 `status`: "
               "unfinished and no run holds it, 6 no space left on OUTPUT's device (free space and run again), "
               "70 internal error (a bug: one line names the file its traceback was written to), "
               "129 / 130 / 131 / 143 interrupted by SIGHUP / SIGINT / SIGQUIT / SIGTERM (committed rows kept; run "
               "again to resume).")


# Commands built on first use (_LazyGroup): name -> the module whose `register(app)` adds it.
_LAZY_COMMANDS = {"run": "jobs.run_commands", "submit": "jobs.run_commands", "quantize": "jobs.model_commands",
                  "perplexity": "jobs.model_commands"}
# `--help` lists the commands in this order.
_ORDER = ("run", "submit", "status", "cancel", "job-schema", "doctor", "version", "quantize", "perplexity", "export",
          "report")


def _docstring(module: str, function: str) -> str:
    """The docstring of `module`.`function`, read from its source without importing the module (ast)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"tokenmill's module {module} is missing; reinstall tokenmill")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return inspect.cleandoc(ast.get_docstring(node) or "")


class _LazyGroup(TyperGroup):
    """The top-level group: the commands of _LAZY_COMMANDS are built (their module imported, their options generated)
    on first `get_command`, as click resolves one to run or show its help; while the group formats its own help
    (`tokenmill --help`) it lists them from their docstrings instead, building none."""

    _listing = False

    def list_commands(self, ctx: typer.Context) -> list[str]:
        names = [*self.commands, *(n for n in _LAZY_COMMANDS if n not in self.commands)]
        return sorted(names, key=lambda n: _ORDER.index(n) if n in _ORDER else len(_ORDER))

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        if cmd_name in self.commands or cmd_name not in _LAZY_COMMANDS:
            return super().get_command(ctx, cmd_name)
        if self._listing:  # `tokenmill --help` shows its name and help text, nothing else
            return TyperCommand(cmd_name, help=_docstring(_LAZY_COMMANDS[cmd_name], cmd_name.replace("-", "_")))
        module = importlib.import_module(_LAZY_COMMANDS[cmd_name])
        sub = typer.Typer(add_completion=False)
        module.register(sub)
        built = typer.main.get_group(sub).commands
        self.commands.update(built)
        return built[cmd_name]

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


class _Cli(typer.Typer):
    """The Typer app whose unexpected exceptions (a bug, not a JobError the command maps to an exit code) end as one
    line and exit code 70, the traceback kept in a file (jobs.cli_output.internal_error): never Typer's or Python's
    traceback on a user's terminal. KeyboardInterrupt and SystemExit pass through."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        set_omp_wait_policy()  # before any command imports torch (jobs.process_env)
        try:
            return super().__call__(*args, **kwargs)
        except Exception as e:
            sys.exit(internal_error(e))


app = _Cli(
    help="tokenmill: offline batch LLM inference. Parquet prompts in, completions and a tokens-per-dollar bill out. "
         + _EXIT_CODES,
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=_LazyGroup)


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


@app.command()
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
    from jobs.preflight import check_store

    with exit_on_failure(output):
        check_store(output, "OUTPUT")  # an endpoint where nothing listens: one line in seconds, not botocore's retries
        st = job_status(output)
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
    from jobs.control import cancel_job
    from jobs.preflight import check_store

    with exit_on_failure(output):
        check_store(output, "OUTPUT")  # an endpoint where nothing listens: one line in seconds, not botocore's retries
        message = cancel_job(output, reason)
    err.print(message)


@app.command("job-schema")
def job_schema() -> None:
    """Print the JSON Schema (draft 2020-12) of a job spec file, generated from the spec model: point an editor's
    YAML language server at it, or check specs with it in CI. The same file ships as schemas/job_spec.schema.json."""
    from schemas.job_spec import job_spec_json_schema

    print(json.dumps(job_spec_json_schema(), indent=2))


@app.command()
def doctor(as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
           model: Annotated[str | None, typer.Option(help="A model (as `run --model` takes it) whose family and "
                                                          "shape to report; default: the default model.")] = None
           ) -> None:
    """What this machine is (CPU model and features, cores, memory, GPUs, versions, which kernels build and run),
    what the engine's defaults pick on it (device, dtype, attention) and why, and the model's family (for a
    mixture-of-experts model its experts, total and active per token). Paste it into a bug report. The first run on
    a machine builds the C++ kernels (about 15 s)."""
    from jobs.doctor import machine_report

    report = machine_report(model)
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


output_commands.register(app)

if __name__ == "__main__":
    app()
