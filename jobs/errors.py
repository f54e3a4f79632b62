"""The one domain exception the CLI maps to exit codes."""

from __future__ import annotations


class JobError(Exception):
    """A job could not start or finish as asked. `exit_code`: 2 = bad input or options (nothing ran),
    1 = the job ran but some shards failed (the others are committed)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
