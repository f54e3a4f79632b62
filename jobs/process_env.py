"""The process settings of a job's processes (the `tokenmill` CLI, and the Dask workers it starts or that serve it),
set when the process starts its work, not when a module is imported.

OpenMP's wait policy: libgomp reads OMP_WAIT_POLICY once, when torch loads it, so it must be in the environment
before the process's first `import torch`. By default libgomp's threads spin up to 300,000 rounds at every barrier:
fast on an idle machine, but a job's worker process also runs Dask's event loop, Parquet reads and checkpoint writes
beside the engine's threads, and any other busy process leaves a descheduled intra-op thread's siblings spinning
through their time slices. Measured on the 2-core AVX2 EPYC (bench/README.md "OpenMP wait policy"): `tokenmill run`
of 128 GSM8K rows at 2 threads made 179 output tok per billed device-second with PASSIVE vs 175 spinning; beside two
busy processes the engine took 17 s with PASSIVE vs 91 s spinning. (LLMEngine.generate alone on an idle machine
spins faster, 196 vs 176 tok/s: the engine package leaves the policy to the library user.) A value the user set wins.

Where it is set: the CLI's entry (jobs.cli, before any command runs and imports torch; the LocalCluster workers it
spawns inherit its environment), and the engine plugin's setup on a Dask worker that serves a job (jobs.plugin,
before the engine loads; a worker started by `dask worker` under a nanny gets it from the Dask config too:
infra/k8s's `distributed.nanny.pre-spawn-environ`).
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

OMP_WAIT_POLICY = "PASSIVE"


def set_omp_wait_policy() -> bool:
    """Put OMP_WAIT_POLICY=PASSIVE in this process's environment unless the user set it (module docstring says
    why). Returns whether the policy in effect is known to be the environment's: False when torch (and libgomp
    with it) was imported before this call, which then changes nothing (logged at debug level)."""
    if "torch" in sys.modules:
        log.debug("OMP_WAIT_POLICY not set: torch was imported first (libgomp has read the environment)")
        return False
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    return True
