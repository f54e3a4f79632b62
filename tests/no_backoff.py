"""Tests only: tokenmill's storage retries (engine.object_store.retry_transient, tenacity) without their back-off
sleeps, in this process (`no_backoff()`) and in a LocalCluster's worker processes (`WORKER_PRELOAD`, a Dask worker
preload: this module's `dask_setup`).

A flaky S3 (tests/s3_faults.py) refuses requests by a seeded draw per request, not by time: waiting between tries
changes no outcome, only the wall time (20 back-off sleeps, 5.2 s, in test_cli's flaky S3 run on the 2-core AVX2
EPYC). The retry policy itself (what is retried, how many tries) is untouched, so a test still proves that
tokenmill's own retries carry a job through the faults.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import tenacity

# The modules whose functions carry retry_transient (or a retry_with of one); imported here so that a worker
# patches them before its first shard imports them.
RETRYING_MODULES = ("engine.model_files", "pipeline.attempts", "pipeline.checkpoint", "pipeline.input",
                    "pipeline.shard_rows", "pipeline.storage")
# Dask config that runs `dask_setup` below in each worker a LocalCluster started under it spawns.
WORKER_PRELOAD = {"distributed.worker.preload": [__name__]}


def no_backoff() -> Callable[[], None]:
    """Set the wait of every tenacity-retried function of tokenmill's modules to none; returns the undo."""
    for name in RETRYING_MODULES:
        importlib.import_module(name)
    undo: list[tuple[tenacity.BaseRetrying, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("engine.", "pipeline.", "jobs.")):
            continue
        for obj in list(vars(module).values()):
            retrying = getattr(obj, "retry", None)
            if isinstance(retrying, tenacity.BaseRetrying) and not isinstance(retrying.wait, tenacity.wait_none):
                undo.append((retrying, retrying.wait))
                retrying.wait = tenacity.wait_none()
    if not undo:
        raise RuntimeError(f"no tenacity-retried function found in {RETRYING_MODULES}: update tests/no_backoff.py")

    def restore() -> None:
        for retrying, wait in undo:
            retrying.wait = wait

    return restore


def dask_setup(worker: Any) -> None:
    """Dask worker preload hook (WORKER_PRELOAD): no back-off in this worker process."""
    no_backoff()
