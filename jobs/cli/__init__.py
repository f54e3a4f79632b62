"""`tokenmill`: the command line. Thin Typer commands that build a config, call the core, map JobError to exit codes.

This package is the app (`tokenmill = "jobs.cli:app"`; `python -m jobs.cli`); the commands live in its modules:
run_commands (run, submit), job_commands (status, cancel), info_commands (job-schema, doctor, version),
model_commands (quantize, perplexity) and output_commands (export, report). NOTE: each command imports what it needs
when it runs, so `tokenmill --help` loads neither torch nor Dask, and `status` / `cancel` no torch
(tests/jobs/test_cli_imports.py). The commands whose options are generated from the job spec (run, submit,
perplexity; jobs.cli.options) and quantize are built only when they run or show their own help (_LazyGroup): the spec
model (pydantic) is about a third of `tokenmill --help`'s time, and `--help`, `status` and `cancel` do not need it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from jobs.cli import info_commands, job_commands, output_commands
from jobs.cli.output import internal_error
from jobs.process_env import set_omp_wait_policy

_EXIT_CODES = ("Exit codes: 0 done (or nothing left to do), 1 some shards failed, 2 bad input, options or spec "
               "(nothing ran), 3 another run holds the job, 4 the job was cancelled (use --resume), 5 `status`: "
               "unfinished and no run holds it, 6 no space left on OUTPUT's device (free space and run again), "
               "70 internal error (a bug: one line names the file its traceback was written to), "
               "129 / 130 / 131 / 143 interrupted by SIGHUP / SIGINT / SIGQUIT / SIGTERM (committed rows kept; run "
               "again to resume).")


# Commands built on first use (_LazyGroup): name -> the module whose `register(app)` adds it.
_LAZY_COMMANDS = {"run": "jobs.cli.run_commands", "submit": "jobs.cli.run_commands",
                  "quantize": "jobs.cli.model_commands", "perplexity": "jobs.cli.model_commands"}
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
    line and exit code 70, the traceback kept in a file (jobs.cli.output.internal_error): never Typer's or Python's
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


for _commands in (job_commands, info_commands, output_commands):
    _commands.register(app)
