"""Jobs: specs, Dask orchestration and the `tokenmill` CLI. Wires pipeline/ (one shard) to a cluster."""

import os
import sys

# OpenMP's wait policy for a job's processes. libgomp reads it once, when torch loads it, so it is set here, before
# the first `import torch` of the CLI or of a Dask worker (which imports jobs to run its plugin; the workers the CLI
# starts inherit it too). By default libgomp's threads spin up to 300,000 rounds at every barrier: fast on an idle
# machine, but a job's worker process also runs Dask's event loop, Parquet reads and checkpoint writes beside the
# engine's threads, and any other busy process leaves a descheduled intra-op thread's siblings spinning through
# their time slices. Measured on the 2-core AVX2 EPYC (bench/README.md "OpenMP wait policy"): `tokenmill run` of 128
# GSM8K rows at 2 threads made 179 output tok per billed device-second with PASSIVE vs 175 spinning; beside two busy
# processes the engine took 17 s with PASSIVE vs 91 s spinning. (LLMEngine.generate alone on an idle machine spins
# faster, 196 vs 176 tok/s: the engine package leaves the policy to the library user.) A value the user set wins.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
