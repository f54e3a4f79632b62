"""What this CPU can do, read without torch: its /proc/cpuinfo flags, capped where oneDNN's ISA cap
(ONEDNN_MAX_CPU_ISA) is set, so that one AVX512 machine can run the suite as an AVX2-only or AVX512-without-VNNI
machine would (`make test-cpu-kinds`). The dtype choice (engine.worker.device), the C++ kernels' build
(engine.kernels.cpu_kernels), the client's fit check (jobs.plan.model_fit) and `tokenmill doctor` all read these.
"""

from __future__ import annotations

import os
from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")
#: /proc/cpuinfo flags of native bf16 arithmetic: AVX512-BF16 and AMX tiles (what torch.cpu's
#: _is_avx512_bf16_supported / _is_amx_tile_supported report, engine.worker.device.cpu_has_native_bf16).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_tile"})
ISA_CAP_VAR = "ONEDNN_MAX_CPU_ISA"
# The /proc/cpuinfo flags an ISA cap may leave out (by prefix), and which of them each of oneDNN's caps below AMX
# keeps (oneDNN's cpu_isa_t levels). Caps with AMX keep every flag (_AMX_CAPS).
_GATED = ("avx2", "fma", "avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")
_AVX2 = frozenset({"avx2", "fma"})
_AVX512_CORE = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ISA_CAPS: dict[str, frozenset[str]] = {
    "SSE41": frozenset(), "AVX": frozenset(), "AVX2": _AVX2, "AVX2_VNNI": _AVX2 | {"avx_vnni"},
    "AVX2_VNNI_2": _AVX2 | {"avx_vnni", "avx_vnni_int8", "avx_ne_convert", "avx_ifma"},
    "AVX512_CORE": _AVX512_CORE, "AVX512_CORE_VNNI": _AVX512_CORE | {"avx512_vnni"},
    "AVX512_CORE_BF16": _AVX512_CORE | {"avx512_vnni", "avx512_bf16"},
    "AVX512_CORE_FP16": _AVX512_CORE | {"avx512_vnni", "avx512_bf16", "avx512_fp16"},
    "AVX10_1_512": _AVX512_CORE | {"avx512_vnni", "avx512_bf16", "avx512_fp16"},
}
_AMX_CAPS = ("AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
             "AVX10_2_512_AMX_2")


def cpu_isa_cap() -> str | None:
    """oneDNN's ISA cap, ONEDNN_MAX_CPU_ISA (oneDNN's own variable: its kernels dispatch to at most that ISA;
    https://uxlfoundation.github.io/oneDNN/dev_guide_cpu_dispatcher_control.html), upper-cased; None when unset,
    blank or DEFAULT. With ATEN_CPU_CAPABILITY it makes an AVX512 machine compute as a smaller kind would (`make
    test-cpu-kinds`): oneDNN's int8 and bf16 kernels do by themselves, and tokenmill's own choices read the capped
    flags (cpu_flags). Raises ValueError naming the variable for a value that is not one of ISA_CAPS."""
    raw = os.environ.get(ISA_CAP_VAR, "").strip().upper()
    if not raw or raw == "DEFAULT" or raw in _AMX_CAPS:
        return None
    if raw not in ISA_CAPS:
        raise ValueError(f"{ISA_CAP_VAR}={raw!r} is not an ISA oneDNN knows here; use one of "
                         f"{', '.join([*ISA_CAPS, *_AMX_CAPS, 'DEFAULT'])}, or unset it")
    return raw


def cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags (empty without the file: not Linux), less those above oneDNN's ISA cap when
    ONEDNN_MAX_CPU_ISA sets one (cpu_isa_cap): the one place tokenmill reads what the CPU can do, so an emulated
    smaller kind is seen alike by the dtype choice, the C++ kernels' build and `tokenmill doctor`."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return frozenset()
    flags = frozenset(next((line.partition(":")[2].split() for line in text.splitlines()
                            if line.startswith("flags")), []))
    cap = cpu_isa_cap()
    if cap is None:
        return flags
    allowed = ISA_CAPS[cap]
    return frozenset(f for f in flags if not f.startswith(_GATED) or f in allowed)


def cpu_flags_native_bf16() -> bool:
    """True when this CPU's flags (cpu_flags: capped by ONEDNN_MAX_CPU_ISA) name native bf16 arithmetic
    (NATIVE_BF16_FLAGS); False without /proc/cpuinfo (not Linux). The engine asks torch where no cap is set
    (engine.worker.device.cpu_has_native_bf16); this is the same rule for a process without torch."""
    return not NATIVE_BF16_FLAGS.isdisjoint(cpu_flags())


def cpu_has_avx512() -> bool:
    """True when this CPU's flags (cpu_flags: capped by ONEDNN_MAX_CPU_ISA) name AVX-512 Foundation (avx512f).
    Without it (AVX2-only CPUs: AMD up to Zen 3, Intel client cores) oneDNN's fp32 GEMMs and their epilogues run
    on AVX2 code, where MKL's sgemm is the faster fp32 GEMM at an encoder's shapes (engine.quant.after_load) and a
    GELU epilogue costs more than a separate GELU (engine.quant.packed_linear.PackedLinear.forward_gelu); the C++
    kernels' 16-lane vectors fill one register with it, two without (engine.kernels.cpu_kernels)."""
    return "avx512f" in cpu_flags()
