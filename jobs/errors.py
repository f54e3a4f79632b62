"""The one domain exception the CLI maps to exit codes, and the codes.

Exit codes of `tokenmill run` / `submit` (and `status`, which reports a job's state with the same numbers):
    0  done: every shard is committed (OUTPUT/_SUCCESS), or nothing was left to do
    1  the job ran, but some shards failed (the others are committed); `status`: failed shards, none running
    2  bad input, options or job spec, or options that differ from the job pinned under OUTPUT: nothing ran
    3  another run holds the job's lease (its holder and expiry are printed); `status`: a run holds the job
    4  the job was cancelled (`tokenmill cancel`); `run`/`submit` refuse it unless --resume
    5  `status` only: the job is unfinished (pending or partial shards), or every shard is committed but no
       _SUCCESS seals it (state "unsealed"), and no run holds it: run it again to resume or seal it
    6  no space left on the device of a local OUTPUT (ENOSPC): the line says how much to free; what is committed
       stays, and the same command run again after freeing space resumes
    129, 130, 131, 143  `run`/`submit` interrupted by SIGHUP (a closed terminal) / SIGINT (Ctrl-C) / SIGQUIT
       (Ctrl-\\, taken as SIGTERM) / SIGTERM: running
       shards committed their finished rows and stopped, the lease was released; the same command run again resumes
       (jobs.interrupt). `--dry-run` writes nothing and exits with these codes at once
    70  an internal error (a bug in tokenmill, sysexits' EX_SOFTWARE): one line names it and the file its traceback
       was written to (jobs.cli.output.internal_error)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED_SHARDS = 1
EXIT_USAGE = 2
EXIT_LEASE_HELD = 3
EXIT_CANCELLED = 4
EXIT_INCOMPLETE = 5
EXIT_NO_SPACE = 6
EXIT_INTERNAL = 70  # sysexits.h EX_SOFTWARE
EXIT_SIGHUP = 129
EXIT_SIGINT = 130  # 128 + the signal's number, the shell's convention
EXIT_SIGQUIT = 131
EXIT_SIGTERM = 143


def storage_error(e: BaseException, output_url: str | None = None) -> JobError | None:
    """The one-line JobError for a storage failure a rerun of the job cannot get past by itself, or None for any
    other error: an object store that cannot be reached (exit 2, naming the endpoint and the variable that set it;
    pipeline.store_reach.unreachable_store), a write the store refused (exit 2, naming the object, the operation and
    the credential; pipeline.denied.AccessDenied) and a full OUTPUT device (exit 6, saying how much to free)."""
    from pipeline.denied import AccessDenied
    from pipeline.storage import NoSpaceLeft, is_no_space, no_space_left
    from pipeline.store_reach import unreachable_store

    if (line := unreachable_store(e)) is not None:
        return JobError(line)
    if isinstance(e, AccessDenied):
        return JobError(str(e))
    if isinstance(e, NoSpaceLeft):
        return JobError(str(e), exit_code=EXIT_NO_SPACE)
    if is_no_space(e):
        where = getattr(e, "filename", None) or (output_url or ".").removeprefix("file://")
        return JobError(str(no_space_left(f"{where}/-", 0)), exit_code=EXIT_NO_SPACE)
    return None


class JobError(Exception):
    """A job could not start or finish as asked. `exit_code` is one of the module's EXIT_* codes (default 2: bad
    input or options, nothing ran)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code
