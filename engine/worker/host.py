"""What the machine offers, probed without torch: the memory this process may still take (and the CPU KV pool's share
of it) and whether nvidia-smi lists a GPU (what the CPU computes natively: engine.kernels.cpu_features). The engine
(engine.worker.device) sizes its CPU KV pool from these; the client's checks (jobs.plan.model_fit, jobs.plan.preflight)
read the same numbers in a process that never imports torch (issue 31).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from engine.config import EngineConfig

# Share of the memory available to the process (memory_available_bytes) that the KV pool takes on the CPU when
# kv_cache_memory_bytes is None ("auto"). The pool's pages are mapped as blocks are first used (cpu_zeros), so the
# share is a ceiling, not what a small batch holds; half leaves the rest for activations, logits and the page cache.
CPU_KV_MEMORY_SHARE = 0.5
_CGROUP = Path("/sys/fs/cgroup")


def _cgroup_headroom_bytes() -> int | None:
    """Bytes this process's cgroup may still take (a container's memory limit: cgroup v2 memory.max - memory.current,
    or v1 memory.limit_in_bytes - memory.usage_in_bytes); None without a limit or cgroup files."""
    for limit, usage in ((_CGROUP / "memory.max", _CGROUP / "memory.current"),
                         (_CGROUP / "memory" / "memory.limit_in_bytes", _CGROUP / "memory" / "memory.usage_in_bytes")):
        try:
            cap, used = limit.read_text().strip(), usage.read_text().strip()
        except OSError:
            continue
        if cap == "max" or not cap.isdigit() or not used.isdigit() or int(cap) >= 1 << 60:  # v1's "no limit"
            return None
        return max(int(cap) - int(used), 0)
    return None


def memory_available_bytes() -> int:
    """Bytes of RAM this process can still take: the OS's available memory (psutil: MemAvailable on Linux), or less
    where a container's cgroup limit leaves less (Kubernetes' resources.limits.memory)."""
    available = psutil.virtual_memory().available
    headroom = _cgroup_headroom_bytes()
    return available if headroom is None else min(available, headroom)


def cpu_kv_budget_bytes(config: EngineConfig) -> int:
    """Bytes of the KV pool on the CPU: config.kv_cache_memory_bytes, or for None ("auto") CPU_KV_MEMORY_SHARE of
    memory_available_bytes(), and of what the process does not hold yet of config.memory_limit_bytes when set (a
    Dask worker's memory limit: jobs.plugin)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    room = memory_available_bytes()
    if config.memory_limit_bytes is not None:
        room = min(room, max(config.memory_limit_bytes - psutil.Process().memory_info().rss, 0))
    return int(CPU_KV_MEMORY_SHARE * room)


def nvidia_smi_gpus() -> int:
    """GPUs `nvidia-smi -L` lists (0 without nvidia-smi, or where it fails: no driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())
