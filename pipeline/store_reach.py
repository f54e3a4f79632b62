"""An object store that cannot be reached, said in one line: before any work, a TCP probe of a configured S3 endpoint
(probe_endpoint), and afterwards, any error whose cause is an unreachable endpoint turned into a line naming the
endpoint and the setting it came from (unreachable_store), instead of botocore's 10-30 s of retries and traceback."""

from __future__ import annotations

import os

import fsspec

# Where boto and s3fs take an S3 endpoint from, in the order they are honoured.
S3_ENDPOINT_ENVS = ("FSSPEC_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


class StoreUnreachable(ConnectionError):
    """An object store's endpoint did not answer (probe_endpoint). str(): one line naming the endpoint, the setting it
    came from and the fix."""


# probe_endpoint: tries, seconds each connect may take, seconds between tries (worst case ~8 s in all).
PROBE_TRIES, PROBE_TIMEOUT_S, PROBE_WAIT_S = 3, 2.0, 0.5


def probe_endpoint(url: str) -> None:
    """Before any work on an S3 URL whose endpoint is configured (FSSPEC_S3_ENDPOINT_URL, AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL, or the filesystem's endpoint_url), check that something listens there: a TCP connect,
    PROBE_TRIES tries. Without it, botocore's own retries take 10-30 s to fail, with a long traceback. Nothing for
    other URLs or AWS's default endpoints (reached through DNS, their errors are botocore's). Raises
    StoreUnreachable."""
    import socket
    import time
    from urllib.parse import urlsplit

    fs, _ = fsspec.core.url_to_fs(url)
    if not hasattr(fs, "call_s3"):
        return
    endpoint = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    env = next((name for name in S3_ENDPOINT_ENVS if os.environ.get(name) and (
        not endpoint or os.environ[name] == endpoint)), None)
    if env is not None:
        endpoint, source = os.environ[env], f"set by {env}={os.environ[env]}"
    elif endpoint:
        source = "the endpoint_url of the fsspec configuration"
    else:
        return
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    error: OSError | None = None
    for attempt in range(PROBE_TRIES):
        try:
            socket.create_connection((parts.hostname or "", port), timeout=PROBE_TIMEOUT_S).close()
            return
        except OSError as e:
            error = e
            if attempt + 1 < PROBE_TRIES:
                time.sleep(PROBE_WAIT_S * (attempt + 1))
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    raise StoreUnreachable(f"cannot reach the object store at {parts.scheme}://{parts.netloc} ({source}): {reason} "
                           f"({PROBE_TRIES} tries). Check that the endpoint is right and up, or unset the variable to "
                           "use the store's default endpoint")


def unreachable_store(exc: BaseException) -> str | None:
    """One line for an object store that cannot be reached (connection refused, DNS, connect timeout): the endpoint
    and the setting it came from; None for any other error. Looks through the exception's causes."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, StoreUnreachable):
            return str(e)
        name = type(e).__name__
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                    "ClientConnectorError", "ServerTimeoutError"):
            endpoint = getattr(e, "kwargs", {}).get("endpoint_url") or str(e)
            return (f"cannot reach the object store at {_endpoint_of(endpoint)} ({_endpoint_source()}): "
                    f"{_short(e)}. Check that the endpoint is right and up, or unset the variable to use the "
                    "store's default endpoint")
        e = e.__cause__ or e.__context__
    return None


def _endpoint_of(text: str) -> str:
    """scheme://host:port of the first URL in `text` (a request URL, or an error message quoting one)."""
    from urllib.parse import urlsplit

    for token in text.replace('"', " ").replace("'", " ").split():
        if "://" in token:
            parts = urlsplit(token)
            return f"{parts.scheme}://{parts.netloc}"
    return text


def _endpoint_source() -> str:
    for name in S3_ENDPOINT_ENVS:
        if os.environ.get(name):
            return f"set by {name}={os.environ[name]}"
    return "the default endpoint of the AWS region, or endpoint_url in ~/.aws/config"


def _short(e: BaseException) -> str:
    reason = getattr(e, "kwargs", {}).get("error")
    text = str(reason if reason is not None else e)
    return text.splitlines()[0][:200] if text else type(e).__name__
