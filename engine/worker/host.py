"""What the machine offers, probed without torch: the memory this process may still take, whether the CPU computes
bf16 natively, whether nvidia-smi lists a GPU. The engine (engine.worker.device) sizes its CPU KV pool from these;
the CLI's fit check (jobs.model_fit) reads the same numbers in a client that never imports torch (issue 31).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import psutil

# Share of the memory available to the process (memory_available_bytes) that the KV pool takes on the CPU when
# kv_cache_memory_bytes is None ("auto"). The pool's pages are mapped as blocks are first used (cpu_zeros), so the
# share is a ceiling, not what a small batch holds; half leaves the rest for activations, logits and the page cache.
CPU_KV_MEMORY_SHARE = 0.5
_CGROUP = Path("/sys/fs/cgroup")
_CPUINFO = Path("/proc/cpuinfo")
#: /proc/cpuinfo flags of native bf16 arithmetic: AVX512-BF16 and AMX tiles (what torch.cpu's
#: _is_avx512_bf16_supported / _is_amx_tile_supported report, engine.worker.device.cpu_has_native_bf16).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_tile"})


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


def cpu_flags_native_bf16() -> bool:
    """True when /proc/cpuinfo's flags name native bf16 arithmetic (NATIVE_BF16_FLAGS); False without the file
    (not Linux). The engine asks torch (engine.worker.device.cpu_has_native_bf16); this is the same rule for a
    process without torch."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return False
    flags = next((line.partition(":")[2].split() for line in text.splitlines() if line.startswith("flags")), [])
    return not NATIVE_BF16_FLAGS.isdisjoint(flags)


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
