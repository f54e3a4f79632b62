"""What every `tokenmill` command prints through: the consoles (stdout, stderr) and the one-line error with its exit
code. Imports nothing heavy (the CLI's `--help` and `status` must not load torch or Dask)."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape

from jobs.errors import EXIT_INTERNAL, JobError, storage_error

err = Console(stderr=True, soft_wrap=True)  # an error line stays one line in logs (no wrap at 80 columns)
out = Console()


def fail(e: Exception, code: int = 2, set_by: dict[str, str] | None = None) -> typer.Exit:
    """Print `e` as one error line on stderr (naming the environment variables in `set_by` that set an option it
    names) and return the typer.Exit of `code` for the caller to raise."""
    err.print(f"[red]error:[/red] {escape(name_env_vars(str(e), set_by or {}))}")
    return typer.Exit(code)


def storage_fail(e: Exception, output: str) -> typer.Exit | None:
    """One line and its exit code for a storage failure (jobs.errors.storage_error); None for other errors."""
    failure = storage_error(e, output)
    return None if failure is None else fail(failure, failure.exit_code)


@contextmanager
def exit_on_failure(output: str, set_by: dict[str, str] | None = None,
                    on_error: Callable[[], None] | None = None) -> Iterator[None]:
    """What the work inside raises, as a command's one error line and exit code: a JobError with its own code
    (`fail`, naming the environment variables in `set_by` that set an option it names), a storage failure at
    `output` (storage_fail: an unreachable store, a refused write, a full device) with its code. typer.Exit and any
    other error pass through (an unexpected one ends as the internal-error line: jobs.cli's app). `on_error` runs
    first for either line (a progress bar stopped before the line is printed) and for an error passed on."""
    try:
        yield
    except typer.Exit:
        raise
    except JobError as e:
        if on_error is not None:
            on_error()
        raise fail(e, e.exit_code, set_by) from e
    except Exception as e:
        if on_error is not None:
            on_error()
        if (failure := storage_fail(e, output)) is None:
            raise
        raise failure from e


def name_env_vars(message: str, set_by: dict[str, str]) -> str:
    """`message` with a note for each option it names (--device) whose value came from an environment variable
    (`set_by`: option name -> variable) that the message does not name yet: the user must find what to fix."""
    for name, envvar in set_by.items():
        flag = "--" + name.replace("_", "-")
        if envvar not in message and re.search(rf"{re.escape(flag)}(?![\w-])", message):
            message += f" ({flag} was set by the environment variable {envvar}: fix or unset it)"
    return message


def ran_in(dtypes: list[str], quantizations: list[str]) -> str:
    """"bfloat16 / none": what the committed shards ran in; every distinct value when shards differ."""
    return f"{', '.join(dtypes) or 'n/a'} / {', '.join(quantizations) or 'n/a'}"


def internal_error(e: BaseException) -> int:
    """An exception no command expected (a bug): write its full traceback to a file of its own (TOKENMILL_LOG_DIR,
    default the system temp folder), print one line on stderr naming the error, the file and how to report it, and
    return EXIT_INTERNAL for the caller to exit with. A user never sees a raw traceback; the maintainers still get it.
    When the file cannot be written the traceback goes to stderr after the line (it is not lost)."""
    text = "".join(traceback.format_exception(e))
    message = " ".join(str(e).split())[:300] or "(no message)"
    try:
        from schemas import settings

        folder = settings.env_text(settings.LOG_DIR) or tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="tokenmill-error-", suffix=".log", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(f"tokenmill {' '.join(sys.argv[1:])}\n{text}")
    except OSError as write_error:
        where = f"the traceback below (it could not be written to a file: {write_error})"
        path = None
    else:
        where = f"the full traceback is in {path}"
    err.print(f"[red]internal error:[/red] {escape(type(e).__name__)}: {escape(message)}. This is a bug in "
              f"tokenmill; {escape(where)}: please report it with that traceback and the output of "
              "`tokenmill doctor`.")
    if path is None:
        sys.stderr.write(text)
    return EXIT_INTERNAL
