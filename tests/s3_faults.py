"""A flaky S3 for tests: moto's S3 served by werkzeug on 127.0.0.1 (a free port) behind a WSGI middleware that
answers a share of requests with 503 SlowDown or 500 InternalError, as S3 does under load.

Two kinds of faults, drawn from a seeded RNG (the draws are deterministic; which request gets which draw depends on
the order requests arrive, which threads and processes decide):
- refused: the request never reaches moto (503 SlowDown or 500 InternalError), so a retry does the work;
- lost: a PUT reaches moto and lands, but the client gets 500 InternalError; the retry of a create-only PUT then
  meets 412 PreconditionFailed (FileExistsError), the case "committed, but the answer was lost".

`flaky_s3_env` points boto/s3fs at it through the environment (also inherited by Dask worker processes) and turns
botocore's retries off (AWS_MAX_ATTEMPTS=1), so faults reach tokenmill's retries (pipeline.storage.retry_transient,
tenacity). s3fs still retries SlowDown itself (its class attribute `retries`, 5 tries, has no environment or
constructor setting in this version), but not InternalError: two thirds of the refused requests get InternalError,
and every lost answer is one, so those reach tenacity directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest

_ERRORS = {503: ("SlowDown", "Please reduce your request rate."),
           500: ("InternalError", "We encountered an internal error. Please try again.")}


def _error_body(status: int) -> bytes:
    code, message = _ERRORS[status]
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>tokenmill-fault</RequestId></Error>").encode()


@dataclass
class FaultStats:
    """What the middleware did: requests seen, refused and lost (by method)."""

    requests: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)

    @property
    def faults(self) -> int:
        """Refused plus lost requests."""
        return sum(self.refused.values()) + sum(self.lost.values())


class FaultInjector:
    """WSGI middleware in front of `app` (moto): refuses a `rate` share of the requests `applies` selects with 503
    SlowDown / 500 InternalError, and answers a `lost_rate` share of PUTs with 500 after they landed.

    Args:
        app: the WSGI app to protect.
        rate: share of selected requests refused, in [0, 1).
        lost_rate: share of selected PUTs whose answer is replaced by a 500 after they landed, in [0, 1).
        seed: seed of the RNG that draws the faults.
        applies: which requests may fail, from the WSGI environ (default: requests on object keys, i.e. a path
            below the bucket; bucket-level calls such as CreateBucket pass).

    `delay`, when set, gets every request's environ and returns seconds to hold it before serving it (a slow S3).
    """

    def __init__(self, app: Callable[..., Iterable[bytes]], rate: float = 0.15, lost_rate: float = 0.05,
                 seed: int = 0, applies: Callable[[dict[str, Any]], bool] | None = None) -> None:
        self.app, self.rate, self.lost_rate = app, rate, lost_rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.applies = applies or (lambda environ: environ.get("PATH_INFO", "/").strip("/").count("/") >= 1)
        self.stats = FaultStats()
        self.enabled = True
        self.delay: Callable[[dict[str, Any]], float] | None = None

    def _draw(self) -> float:
        with self.lock:
            self.stats.requests += 1
            return self.rng.random()

    def _count(self, kind: dict[str, int], method: str) -> None:
        with self.lock:
            kind[method] = kind.get(method, 0) + 1

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        if self.delay is not None and (seconds := self.delay(environ)) > 0:
            time.sleep(seconds)
        if not self.enabled or not self.applies(environ):
            return self.app(environ, start_response)
        draw = self._draw()
        if draw < self.rate:
            self._count(self.stats.refused, method)
            status = 503 if draw < self.rate / 3 else 500
            return self._fail(status, method, start_response)
        if method == "PUT" and draw < self.rate + self.lost_rate:
            # Let it land, then lose the answer.
            landed = self.app(environ, lambda *a, **k: lambda data: None)
            for _ in landed:
                pass
            if hasattr(landed, "close"):
                landed.close()
            self._count(self.stats.lost, method)
            return self._fail(500, method, start_response)
        return self.app(environ, start_response)

    @staticmethod
    def _fail(status: int, method: str, start_response: Callable[..., Any]) -> list[bytes]:
        body = b"" if method == "HEAD" else _error_body(status)
        reason = "Service Unavailable" if status == 503 else "Internal Server Error"
        start_response(f"{status} {reason}", [("Content-Type", "application/xml"),
                                              ("Content-Length", str(len(body)))])
        return [body]


@dataclass
class FlakyS3:
    """A running flaky S3: its endpoint URL, a bucket created in it, and the fault injector (stats, enabled)."""

    endpoint_url: str
    bucket: str
    faults: FaultInjector


class GetCounter:
    """A FaultInjector `delay` that counts the GET requests of object keys (`gets`, by "bucket/key") and holds the
    GETs of the keys in `hold` until `release` is set (at most 60 s): a slow download to kill a process in."""

    def __init__(self) -> None:
        self.gets: Counter[str] = Counter()
        self.hold: set[str] = set()
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any]) -> float:
        if environ.get("REQUEST_METHOD") == "GET" and not environ.get("QUERY_STRING"):
            key = environ.get("PATH_INFO", "").lstrip("/")
            with self._lock:
                self.gets[key] += 1
            if key in self.hold:
                self.release.wait(60)
        return 0.0


def upload_folder(bucket: str, local: str, prefix: str) -> str:
    """Upload the files of the local folder `local` under s3://bucket/prefix/; returns that URL (with its "/")."""
    fs = fsspec.filesystem("s3")
    for name in sorted(os.listdir(local)):
        fs.put_file(os.path.join(local, name), f"{bucket}/{prefix}/{name}")
    return f"s3://{bucket}/{prefix}/"


@contextmanager
def flaky_s3_server(rate: float = 0.15, lost_rate: float = 0.05, seed: int = 0) -> Iterator[tuple[str, FaultInjector]]:
    """Serve moto's S3 behind a FaultInjector on 127.0.0.1 (a free port); yields (endpoint URL, injector)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    faults = FaultInjector(DomainDispatcherApplication(create_backend_app), rate, lost_rate, seed)
    server = make_server("127.0.0.1", 0, faults, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, name="flaky-s3", daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}", faults
    finally:
        server.shutdown()
        thread.join()


@contextmanager
def flaky_s3_env(endpoint_url: str, bucket: str) -> Iterator[None]:
    """Point boto/s3fs at `endpoint_url` through the environment (AWS_ENDPOINT_URL, test credentials), with
    botocore's own retries off, and create `bucket`. Child processes started inside inherit it all."""
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint_url, "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        fsspec.filesystem("s3").clear_instance_cache()
        with contextlib.suppress(FileExistsError):  # CreateBucket is bucket-level: never faulted
            fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
        try:
            yield
        finally:
            fsspec.filesystem("s3").clear_instance_cache()


@contextmanager
def flaky_s3(rate: float = 0.15, lost_rate: float = 0.05, seed: int = 0,
             bucket: str | None = None) -> Iterator[FlakyS3]:
    """flaky_s3_server + flaky_s3_env: a bucket on a flaky S3 that this process and its children use. The bucket is
    new each time unless named: moto's backend is process-wide, so a fixed name would carry one test's objects into
    the next."""
    bucket = bucket or f"tokenmill-flaky-{uuid.uuid4().hex[:12]}"
    with flaky_s3_server(rate, lost_rate, seed) as (url, faults), flaky_s3_env(url, bucket):
        yield FlakyS3(url, bucket, faults)
