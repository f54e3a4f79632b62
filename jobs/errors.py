"""The one domain exception the CLI maps to exit codes, and the codes.

Exit codes of `tokenmill run` / `submit` (and `status`, which reports a job's state with the same numbers):
    0  done: every shard is committed (OUTPUT/_SUCCESS), or nothing was left to do
    1  the job ran, but some shards failed (the others are committed); `status`: failed shards, none running
    2  bad input, options or job spec, or options that differ from the job pinned under OUTPUT: nothing ran
    3  another run holds the job's lease (its holder and expiry are printed); `status`: a run holds the job
    4  the job was cancelled (`tokenmill cancel`); `run`/`submit` refuse it unless --resume
    5  `status` only: the job is unfinished (pending or partial shards) and no run holds it: submit it again
    130, 143  `run`/`submit` interrupted by SIGINT (Ctrl-C) / SIGTERM: running shards committed their finished rows
       and stopped, the lease was released; the same command run again resumes (jobs.interrupt)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED_SHARDS = 1
EXIT_USAGE = 2
EXIT_LEASE_HELD = 3
EXIT_CANCELLED = 4
EXIT_INCOMPLETE = 5
EXIT_SIGINT = 130  # 128 + the signal's number, the shell's convention
EXIT_SIGTERM = 143


class JobError(Exception):
    """A job could not start or finish as asked. `exit_code` is one of the module's EXIT_* codes (default 2: bad
    input or options, nothing ran)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code
