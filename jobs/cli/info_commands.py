"""`tokenmill job-schema`, `tokenmill doctor` and `tokenmill version`: what the spec file, this machine and this
install are. Wire them in with `register(app)`; each imports what it reads when it runs.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def job_schema() -> None:
    """Print the JSON Schema (draft 2020-12) of a job spec file, generated from the spec model: point an editor's
    YAML language server at it, or check specs with it in CI. The same file ships as schemas/job_spec.schema.json."""
    from schemas.job_spec import job_spec_json_schema

    print(json.dumps(job_spec_json_schema(), indent=2))


def doctor(as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
           model: Annotated[str | None, typer.Option(help="A model (as `run --model` takes it) whose family and "
                                                          "shape to report; default: the default model.")] = None
           ) -> None:
    """What this machine is (CPU model and features, cores, memory, GPUs, versions, which kernels build and run),
    what the engine's defaults pick on it (device, dtype, attention) and why, and the model's family (for a
    mixture-of-experts model its experts, total and active per token). Paste it into a bug report. The first run on
    a machine builds the C++ kernels (about 15 s)."""
    from jobs.cli.doctor import machine_report

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


def version() -> None:
    """Print tokenmill's version."""
    from importlib.metadata import version as dist_version

    print(dist_version("tokenmill"))


def register(app: typer.Typer) -> None:
    """Add the `job-schema`, `doctor` and `version` commands to `app`."""
    app.command("job-schema")(job_schema)
    app.command()(doctor)
    app.command()(version)
