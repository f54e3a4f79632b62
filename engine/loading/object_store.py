"""fsspec object-store helpers shared by the engine's model copies (engine.loading.model_files) and pipeline/ (its
commits):
the retry policy for transient storage errors, and an object's version (ETag, else last-modified time).

Lives in the engine because pipeline/ imports the engine and the engine imports no pipeline.
"""

from __future__ import annotations

import errno
from typing import Any

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential

# errnos that s3fs and the OS give for a server or network having a bad moment (s3fs: SlowDown and
# ServiceUnavailable -> EBUSY, InternalError -> EREMOTEIO).
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EREMOTEIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                     errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE}


def is_no_space(exc: BaseException) -> bool:
    """True when `exc` is a full device (ENOSPC, EDQUOT: a quota is a full disk for this user)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying (throttling, 5xx, timeouts, connection resets); False for answers that
    a retry cannot change (exists, not found, access denied, a corrupt file, a full disk, an object replaced since it
    was opened)."""
    if isinstance(exc, FileExistsError | FileNotFoundError | PermissionError | IsADirectoryError):
        return False
    if is_no_space(exc) or type(exc).__name__ == "FileExpired":  # s3fs's FileExpired says EBUSY, but it is final
        return False
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


#: Tries of retry_transient (the first included).
RETRY_ATTEMPTS = 5
# NOTE: s3fs/botocore retry inside each call too; the layers multiply, so keep this one short (<= ~1 min in all).
retry_transient = retry(retry=retry_if_exception(is_transient), wait=wait_random_exponential(multiplier=0.5, max=15),
                        stop=stop_after_attempt(RETRY_ATTEMPTS), reraise=True)


def modified_at(info: dict[str, Any]) -> float | None:
    """Last-modified time of a listed entry, seconds since the epoch (local mtime, S3 LastModified); None if the
    store does not say."""
    for key in ("mtime", "LastModified", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, int | float):
            return float(value)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
    return None
