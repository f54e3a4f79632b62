"""`python -m jobs.cli`: the `tokenmill` command (jobs.cli.app)."""

from jobs.cli import app

app()
