"""What the CPU can do, capped by oneDNN's ISA cap (engine/kernels/cpu_features.py; issue 50): under
ONEDNN_MAX_CPU_ISA=AVX2 an AVX-512 machine makes every CPU-kind choice as an AVX2-only machine does (7-bit INT8
weights, no bf16 packing, float32 by default, the C++ kernels built for x86-64-v3), which `make test-cpu-kinds` uses
to run the cpu_kind tests as that kind; on an AVX2 machine the same holds without the cap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import cpu_features
from engine.kernels.cpu_features import ISA_CAP_VAR, cpu_flags, cpu_flags_native_bf16, cpu_isa_cap

ROOT = Path(__file__).resolve().parents[3]
ZEN4 = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma "
        "avx512vbmi avx512_vnni avx512_bf16 avx_vnni gfni vaes")


@pytest.fixture
def zen4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC 9004\nflags\t\t: {ZEN4}\n")
    monkeypatch.setattr(cpu_features, "_CPUINFO", info)
    monkeypatch.delenv(ISA_CAP_VAR, raising=False)


def test_no_cap_reads_every_flag(zen4) -> None:
    assert cpu_isa_cap() is None and cpu_flags() == frozenset(ZEN4.split()) and cpu_flags_native_bf16()


@pytest.mark.parametrize(("cap", "kept", "gone"), [
    ("avx2", {"avx2", "fma", "sse4_2", "gfni"}, {"avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni"}),
    ("AVX512_CORE", {"avx512f", "avx512bw", "avx512vl", "avx2"}, {"avx512_vnni", "avx512_bf16", "avx512ifma"}),
    ("AVX512_CORE_VNNI", {"avx512f", "avx512_vnni"}, {"avx512_bf16"}),
    ("AVX512_CORE_BF16", {"avx512_vnni", "avx512_bf16"}, set()),
])
def test_a_cap_leaves_out_the_flags_above_it(zen4, monkeypatch: pytest.MonkeyPatch, cap: str, kept: set[str],
                                             gone: set[str]) -> None:
    monkeypatch.setenv(ISA_CAP_VAR, cap)
    flags = cpu_flags()
    assert kept <= flags and not gone & flags
    assert cpu_flags_native_bf16() == (cap == "AVX512_CORE_BF16")


def test_amx_caps_and_default_cap_nothing(zen4, monkeypatch: pytest.MonkeyPatch) -> None:
    for cap in ("DEFAULT", "avx512_core_amx", " "):
        monkeypatch.setenv(ISA_CAP_VAR, cap)
        assert cpu_isa_cap() is None and cpu_flags() == frozenset(ZEN4.split())


def test_an_unknown_cap_is_an_error_naming_the_variable(zen4, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_CAP_VAR, "AVX3")
    with pytest.raises(ValueError, match=r"ONEDNN_MAX_CPU_ISA='AVX3' is not an ISA oneDNN knows here; use one of"):
        cpu_flags()


def test_the_kernels_build_for_the_capped_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels import cpu_kernels

    monkeypatch.delenv(ISA_CAP_VAR, raising=False)
    assert "-march=native" in cpu_kernels._cflags()
    for cap, march in (("AVX2", "-march=x86-64-v3"), ("AVX512_CORE", "-march=x86-64-v4"),
                       ("AVX512_CORE_BF16", "-march=native")):
        monkeypatch.setenv(ISA_CAP_VAR, cap)
        assert march in cpu_kernels._cflags(), cap


_PROBE = """
import json, torch
from engine.quant.int8_linear import int8_weight_qmax
from engine.quant.packed_linear import bf16_packing_available
from engine.worker.device import cpu_has_native_bf16, resolve_dtype
from engine.kernels.cpu_features import cpu_has_avx512
print(json.dumps({"qmax": int8_weight_qmax(), "bf16_packing": bf16_packing_available(),
                  "native_bf16": cpu_has_native_bf16(), "auto": str(resolve_dtype("auto", torch.device("cpu"))),
                  "avx512": cpu_has_avx512(), "aten": torch.backends.cpu.get_cpu_capability()}))
"""


def test_under_the_avx2_cap_every_choice_is_an_avx2_machines() -> None:
    """In a fresh process (oneDNN and ATen read their variables once): oneDNN's own int8 GEMM saturates as on AVX2
    (7-bit weights), its bf16 reorder is refused (no bf16 packing), and tokenmill's flags agree (float32 by
    default). Holds on an AVX2-only machine with or without the cap."""
    env = {"PATH": "/usr/bin:/bin", ISA_CAP_VAR: "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "TOKENMILL_CPU_KERNELS": "0"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "qmax": 63.0, "bf16_packing": False, "native_bf16": False, "auto": "torch.float32", "avx512": False,
        "aten": "AVX2"}
