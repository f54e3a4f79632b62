"""C++ kernels of the CPU path (engine/kernels/csrc/), compiled for this machine on first use.

`cpu_ops()` builds engine/kernels/csrc/ (cpu_kernels.cpp, encoder_kernels.cpp) with torch.utils.cpp_extension.load (g++
and ninja; -O3 -march=native, so the build is for the CPU it runs on) into torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), under a name that hashes the source (its path and text), the
flags, torch's version and this CPU's flags: later processes on the same machine load it in well under a second (a build
takes about 15 s on 2 cores: the source includes only the ATen headers it uses, not <torch/extension.h>), and concurrent
first builds wait on torch's file lock. When the build cannot run (no compiler, no ninja, a build error) or
TOKENMILL_CPU_KERNELS=0 is set, `cpu_ops()` returns None, a warning names the reason once, and callers use the plain
torch path, which computes the same function.

`python -m engine.kernels.cpu_kernels` (`make kernels`, which `make setup` runs) builds them ahead of use, so a fresh
clone's first test or job does not wait for the compiler; a process that finds them built loads them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from engine.kernels.cpu_features import cpu_flags, cpu_has_avx512, cpu_isa_cap
from schemas import settings

log = logging.getLogger(__name__)

# Resolved: torch's build.ninja names the source by this path, so every process of one checkout (make, pytest, a
# job's workers) must spell it alike or each would rewrite build.ninja and rebuild the module.
_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [_CSRC / "cpu_kernels.cpp", _CSRC / "encoder_kernels.cpp"]
HEADERS = [_CSRC / "simd_avx2.h"]  # in the build's name too: a changed header is a new build
# The kernels vectorize by hand (GCC vector extensions), so no -ffast-math: the softmax needs -inf and exact order.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cpu_flags() -> str:
    """The flags the build is keyed on: this CPU's, capped by ONEDNN_MAX_CPU_ISA (engine.worker.host.cpu_flags), or
    the machine's name without /proc/cpuinfo."""
    flags = cpu_flags()
    return " ".join(sorted(flags)) if flags else os.uname().machine


def _cflags() -> list[str]:
    """CFLAGS, with -march for the capped kind instead of native under an ISA cap below AVX-512 or at AVX512_CORE
    (x86-64-v3: AVX2 + FMA; x86-64-v4: AVX-512 F/BW/CD/DQ/VL), so an emulated smaller kind runs its own code."""
    cap = cpu_isa_cap()
    if cap is None or cap.startswith("AVX512_CORE_") or cap.startswith("AVX10"):
        return CFLAGS
    march = "-march=x86-64-v4" if cap == "AVX512_CORE" else "-march=x86-64-v3" if cap.startswith("AVX2") else \
        "-march=x86-64-v2"
    return [march if f == "-march=native" else f for f in CFLAGS]


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """While the kernels build: this interpreter's folder first on PATH when ninja is not on PATH (pip puts ninja
    beside the interpreter, which a venv may not have on PATH; torch's build runs `ninja` by name). PATH is as it was
    afterwards: the process's environment is not changed for anything else."""
    if shutil.which("ninja") is not None:
        yield
        return
    old = os.environ.get("PATH")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + (old or "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled kernels (paged_attention, rms_norm, add_rms_norm, rope_write_kv, silu_and_mul,
    quantize_rows_u8, argmax_rows, sample_rows, gguf_linear; encoder_attention from encoder_kernels.cpp), or None when
    they cannot be built here."""
    if not settings.env_flag(settings.CPU_KERNELS):
        return None
    digest = hashlib.sha256()
    for src in SOURCES + HEADERS:
        # The path too: torch's build.ninja names the source by path, so two checkouts of one source sharing a name
        # would rebuild each other's module (about 30 s) every time a process of the other one loads it.
        digest.update(str(src).encode() + b"\0" + src.read_bytes())
    digest.update(" ".join(_cflags() + [torch.__version__, _cpu_flags()]).encode())
    name = f"tokenmill_cpu_{digest.hexdigest()[:16]}"
    try:
        from torch.utils.cpp_extension import load

        with _ninja_on_path():
            return load(name, [str(s) for s in SOURCES], extra_cflags=_cflags(), verbose=False)
    except Exception as e:  # no compiler / ninja, or a build error: the torch path does the same work
        log.warning("tokenmill's CPU kernels could not be built (%s: %s); using the plain torch path, which is "
                    "slower. Install g++ and ninja (pip install ninja) to get them.", type(e).__name__,
                    str(e).strip().splitlines()[-1:] if str(e).strip() else "")
        return None


def encoder_fp32_ops(x: torch.Tensor) -> ModuleType | None:
    """The C++ kernels when their encoder kernels (csrc/encoder_kernels.cpp: encoder_attention, bias_gelu_,
    bias_residual_layer_norm_) serve activation `x`: fp32 on a CPU without AVX-512 (where they are measured: on an AVX2
    EPYC they beat torch's SDPA, GELU and LayerNorm passes, bench/README.md "Embeddings on an AVX2-only CPU"; on
    AVX-512 CPUs, where they are not measured and the encoder's GEMMs are oneDNN's with a GELU epilogue, torch's ops
    run), autograd off (no backward), a build for AVX2 + FMA. None otherwise: the torch ops run, the same function."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() or cpu_has_avx512():
        return None
    ops = cpu_ops()
    return ops if ops is not None and ops.encoder_attention_available() else None


def main() -> int:
    """`python -m engine.kernels.cpu_kernels`: build (or load, when built) the kernels of this checkout and print the
    module's
    path. Exit status 1, with the reason logged, when they cannot be built; 0 when TOKENMILL_CPU_KERNELS=0 turns them
    off."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not settings.env_flag(settings.CPU_KERNELS):
        print("TOKENMILL_CPU_KERNELS=0: the CPU kernels are off, nothing to build")
        return 0
    ops = cpu_ops()
    if ops is None:
        return 1
    print(f"tokenmill CPU kernels: {ops.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
