"""glibc malloc's thresholds for a CPU engine (engine.worker.host_malloc): with them, memory a forward frees is
mapped again for the next one without page faults; TOKENMILL_MALLOC_TUNE=0 leaves malloc as it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.worker import host_malloc
from schemas import settings

# A forward's pattern, in a fresh process: three 12 MB activations written, then all freed, twenty times over (the
# C library's malloc and memset directly, no torch). Prints the minor page faults of the last nineteen rounds.
_ROUNDS = """
import ctypes, json, resource, sys
from engine.worker.host_malloc import keep_freed_memory
tuned = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 12 << 20
def forward():
    blocks = [libc.malloc(size) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
forward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(19):
    forward()
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _rounds(tune: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", settings.MALLOC_TUNE: tune}
    run = subprocess.run([sys.executable, "-c", _ROUNDS], capture_output=True, text=True, env=env, timeout=60,
                         check=True)
    return json.loads(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_freed_activations_are_mapped_again_without_page_faults() -> None:
    default, tuned = _rounds("0"), _rounds("1")
    assert default["tuned"] is False and tuned["tuned"] is True
    pages = 19 * 3 * (12 << 20) // 4096  # what the rounds write: faulted again and again when trimmed away
    assert default["faults"] > pages // 2  # glibc's defaults hand the freed heap top back each round
    assert tuned["faults"] < pages // 20  # kept: written again in place


def test_the_switch_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    host_malloc.keep_freed_memory.cache_clear()
    monkeypatch.setenv(settings.MALLOC_TUNE, "0")
    assert host_malloc.keep_freed_memory() is False
    host_malloc.keep_freed_memory.cache_clear()
    monkeypatch.setenv(settings.MALLOC_TUNE, "sometimes")
    with pytest.raises(ValueError, match="TOKENMILL_MALLOC_TUNE"):
        host_malloc.keep_freed_memory()
    host_malloc.keep_freed_memory.cache_clear()
