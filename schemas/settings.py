"""Every TOKENMILL_* environment variable tokenmill reads, and the other tools' variables it acts on itself
(TRITON_INTERPRET), named once, parsed once, read when asked (at call time, never when a module is imported: a test
or a worker that sets one after import gets what it set).

The job options that also come from the environment (TOKENMILL_DEVICE, TOKENMILL_MODEL, ...) are declared with
their spec field (schemas.spec_sections, Cli.envvar) and read by the CLI's option parser; this module holds the
others. Plain Python: schemas is the bottom layer, so the engine, the pipeline and the jobs all read through it.
A bad value is a ValueError naming the variable and what it takes.
"""

from __future__ import annotations

import os
from pathlib import Path

# engine
WEIGHTS_CACHE = "TOKENMILL_WEIGHTS_CACHE"  # 0: never cache a GGUF's dequantized weights (engine.loading.weights_cache)
WEIGHTS_CACHE_GB = "TOKENMILL_WEIGHTS_CACHE_GB"  # the weights cache's size limit, GB (engine.loading.weights_cache)
CACHE_DIR = "TOKENMILL_CACHE_DIR"  # tokenmill's cache folder (engine.text.tokenizer.cache_root)
CPU_KERNELS = "TOKENMILL_CPU_KERNELS"  # 0: no C++ CPU kernels (engine.kernels.cpu_kernels)
TRITON_FUSED = "TOKENMILL_TRITON_FUSED"  # 0: no fused Triton kernels (engine.kernels.triton_fused)
TRITON_MOE = "TOKENMILL_TRITON_MOE"  # 0: MoE experts on CUDA run the torch loop (engine.kernels.triton_moe)
GGUF_KERNEL = "TOKENMILL_GGUF_KERNEL"  # 0: no small-batch GGUF block kernel (engine.quant.packed_linear)
MALLOC_TUNE = "TOKENMILL_MALLOC_TUNE"  # 0: leave glibc malloc's thresholds as they are (engine.worker.host_malloc)
# pipeline
SPOT_NOTICE_FILE = "TOKENMILL_SPOT_NOTICE_FILE"  # a file whose appearance is a spot notice (pipeline.preemption)
SPOT_NOTICE_URL = "TOKENMILL_SPOT_NOTICE_URL"  # an instance-metadata URL that answers 200 on a notice
STOP_POLL_S = "TOKENMILL_STOP_POLL_S"  # seconds between polls of the notice URL and the cancel marker
STOP_DEADLINE_S = "TOKENMILL_STOP_DEADLINE_S"  # seconds a stopped shard may spend committing
# jobs
WORKER_WAIT_S = "TOKENMILL_WORKER_WAIT_S"  # seconds a run waits for a GPU worker to join (jobs.cluster)
PUSHGATEWAY_URL = "TOKENMILL_PUSHGATEWAY_URL"  # where a run pushes its metrics (jobs.metrics)
METRICS_INTERVAL_S = "TOKENMILL_METRICS_INTERVAL_S"  # seconds between metric pushes
JOB_NAME = "TOKENMILL_JOB_NAME"  # the metrics' job label (else the last part of OUTPUT)
LOG_DIR = "TOKENMILL_LOG_DIR"  # where an internal error's traceback is written (jobs.cli.output)
LEASE_TTL_S = "TOKENMILL_LEASE_TTL_S"  # seconds a run's lease on its job lives without renewal (jobs.lease)
# infra: read by infra/'s own files (the Airflow DAG, the cron script), which run where tokenmill may not be installed
# and so name them themselves; listed here so this list is whole (tests/schemas/test_settings.py checks it)
JOB_SPEC = "TOKENMILL_JOB_SPEC"  # the job spec the Airflow DAG submits (infra/airflow)
OUTPUT_ROOT = "TOKENMILL_OUTPUT_ROOT"  # where a scheduled run's OUTPUT folders go, one per date
IMAGE = "TOKENMILL_IMAGE"  # tokenmill's container image (the Airflow DAG's Kubernetes pod)
NAMESPACE = "TOKENMILL_NAMESPACE"  # the Kubernetes namespace of that pod
DASK_SCHEDULER = "TOKENMILL_DASK_SCHEDULER"  # the Dask scheduler that pod submits to (DASK_SCHEDULER_ADDRESS there)
SCHEDULE = "TOKENMILL_SCHEDULE"  # the DAG's cron schedule
BIN = "TOKENMILL_BIN"  # the tokenmill executable where it is not on PATH (the local DAG)
CRON_LOCK_DIR = "TOKENMILL_CRON_LOCK_DIR"  # the cron script's lock folder (infra/cron)
CRON_LOG_DIR = "TOKENMILL_CRON_LOG_DIR"  # the cron script's log folder (infra/cron)
# tests and benchmarks
DATA_DIR = "TOKENMILL_DATA_DIR"  # the real prompt sets (tests/conftest.py, bench/common.py)
# other tools'
TRITON_INTERPRET = "TRITON_INTERPRET"  # 1: Triton's kernels run in its interpreter, on CPU (triton_interpret)

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_text(name: str) -> str | None:
    """The value of environment variable `name`, or None when it is unset or blank."""
    raw = os.environ.get(name)
    return raw if raw is not None and raw.strip() else None


def env_flag(name: str, default: bool = True) -> bool:
    """A switch: 1/true/yes/on or 0/false/no/off (any case); unset or blank: `default`. Raises ValueError naming
    the variable for anything else."""
    raw = env_text(name)
    if raw is None:
        return default
    if raw.strip().lower() in _ON:
        return True
    if raw.strip().lower() in _OFF:
        return False
    raise ValueError(f"{name} must be 1 or 0 (on or off), got {raw!r}")


def env_seconds(name: str, default: float, *, allow_zero: bool = False) -> float:
    """Seconds from environment variable `name` (unset or blank: `default`): the one parser of tokenmill's *_S
    settings. Raises ValueError naming the variable for a non-number, or for a value <= 0 (< 0 with allow_zero)."""
    raw = env_text(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (value >= 0 if allow_zero else value > 0):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} seconds, got {raw!r}")
    return value


def env_gigabytes(name: str, default: float) -> int:
    """Bytes from a size in GB (10^9 bytes) in environment variable `name` (unset or blank: `default` GB). Raises
    ValueError naming the variable for a non-number or a value < 0."""
    raw = env_text(name)
    if raw is None:
        return int(default * 1e9)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a size in GB, got {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0 GB, got {raw!r}")
    return int(value * 1e9)


def triton_interpret() -> bool:
    """Whether TRITON_INTERPRET is "1": Triton's kernels run in its interpreter on CPU tensors (tests, smoke runs).
    Triton reads it once, when it is first imported; the engine reads it to know where its kernels may run."""
    return os.environ.get(TRITON_INTERPRET) == "1"


def cache_dir() -> Path:
    """tokenmill's cache folder: $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill."""
    own = env_text(CACHE_DIR)
    if own is not None:
        return Path(own)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenmill"
