"""glibc malloc's thresholds for a CPU engine: freed activation memory kept for the next forward instead of handed
back to the kernel and faulted in again.

A CPU forward allocates its activations afresh each step: [T, hidden] and [T, intermediate] fp32 tensors of 1-13 MB
at an encoder's 2,048-token batches. glibc serves such sizes from the heap once its dynamic mmap threshold has
grown past them, but trims the heap's top whenever more than twice that threshold lies free there, so each forward
maps the pages again and the kernel zeroes them on first touch: on an AVX2-only AMD EPYC (2 cores), embedding 1,000
real texts with all-MiniLM-L6-v2 spent 9.2 s of system time in those page faults (0.8 s with the thresholds below),
and an elementwise pass that first touches a new tensor (the bias copied into a GEMM's output, a GELU) ran several
times slower than on warm pages (bench/README.md "Embeddings on an AVX2-only CPU"). PyTorch's CPU performance
guide and vLLM's CPU backend swap in tcmalloc or jemalloc (LD_PRELOAD, set before the process starts) for the same
reason; glibc's own knobs (mallopt(3): M_MMAP_THRESHOLD, M_TRIM_THRESHOLD) do it from inside the process.

The cost: up to TRIM_THRESHOLD_BYTES of freed memory stays mapped to the process (its resident size keeps the peak
of its activations). TOKENMILL_MALLOC_TUNE=0 leaves malloc as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

from schemas import settings

log = logging.getLogger(__name__)

# mallopt(3) parameter numbers, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this are served from the heap, not mmap'd (glibc's own ceiling for its dynamic threshold,
#: DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: larger values are refused).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory at the heap's top kept mapped up to this size.
TRIM_THRESHOLD_BYTES = 512 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's M_MMAP_THRESHOLD to MMAP_THRESHOLD_BYTES and M_TRIM_THRESHOLD to TRIM_THRESHOLD_BYTES for this
    process (module docstring), once. Returns whether they were set: False under TOKENMILL_MALLOC_TUNE=0, or where
    the C library is not glibc (no mallopt: macOS, musl), or if glibc refused a value. Raises ValueError naming
    the variable for a TOKENMILL_MALLOC_TUNE that is no switch."""
    if not settings.env_flag(settings.MALLOC_TUNE):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD,
                                                                            TRIM_THRESHOLD_BYTES) == 1
    if not done:
        log.info("glibc refused malloc's thresholds (mallopt); CPU forwards may spend time in page faults")
    return done
