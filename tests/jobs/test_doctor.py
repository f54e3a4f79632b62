"""`tokenmill doctor`: the machine and the defaults it picks, probed on this very machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from jobs.cli.doctor import CPU_FEATURES


def test_doctor_reports_this_machine_and_the_defaults_it_picks() -> None:
    from engine.kernels.cpu_features import cpu_flags, cpu_flags_native_bf16, cpu_isa_cap

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # as a user's shell has it
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "doctor", "--json"], capture_output=True, text=True,
                          timeout=600, check=False, env={**env, "COLUMNS": "160"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout)
    cpuinfo = Path("/proc/cpuinfo")
    cap = cpu_isa_cap()  # ONEDNN_MAX_CPU_ISA: `make test-cpu-kinds` runs this as an AVX2-only CPU
    assert report["cpu"]["isa_cap"] == cap
    if cpuinfo.is_file():
        flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
        if cap is not None:
            assert cpu_flags() < flags
            flags = set(cpu_flags())
        assert report["cpu"]["features"] == [f for f in CPU_FEATURES if f in flags]
    native_bf16 = (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()) if cap is None else (
        cpu_flags_native_bf16())
    assert report["defaults"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert report["defaults"]["dtype"] == ("bfloat16" if torch.cuda.is_available() or native_bf16 else "float32")
    assert report["versions"]["torch"] == torch.__version__
    # The fp32 CPU path reads a GGUF's blocks in small steps (engine.quant.packed_linear); bf16 and CUDA do not.
    small = report["defaults"]["small_batch_kernel"]
    expected = "decode steps of <= 16 rows" if report["defaults"]["dtype"] == "float32" else "off"
    assert small.startswith(expected), small
    # The auto KV pool on the CPU: half of what this process may still take (engine.worker.device.CPU_KV_MEMORY_SHARE).
    room = report["memory_gib"]["available_to_process"]
    assert 0 < room <= report["memory_gib"]["total"]
    assert abs(report["defaults"]["cpu_kv_cache_gib"] - room / 2) < 0.5 + room / 10  # memory moves between probes
    # The CLI (package jobs) sets it before torch loads: OpenMP threads sleep at barriers (jobs/process_env.py).
    assert report["cpu"]["omp_wait_policy"] == "PASSIVE"
    # oneDNN packs bf16 only with AVX512BW/VL/DQ (or AVX-NE-CONVERT); its int8 GEMM sums exactly at 8 bits with VNNI.
    features = set(report["cpu"]["features"])
    if report["kernels"]["onednn"]:
        assert report["kernels"]["bf16_packing"] == ({"avx512bw", "avx512vl", "avx512dq"} <= features
                                                     or "avx_ne_convert" in features)
    if report["kernels"]["int8_gemm"] and not features & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        assert report["kernels"]["int8_weight_bits"] == 7


def test_doctor_prints_a_table_a_person_reads() -> None:
    from typer.testing import CliRunner

    from jobs.cli import app

    result = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "dtype_reason" in result.output and "features" in result.output and "{" not in result.output


def test_the_wait_policy_is_set_by_a_job_process_not_by_an_import() -> None:
    """jobs.process_env: importing jobs (and the CLI's module) changes nothing; the CLI's entry and the engine
    plugin's setup set PASSIVE before torch loads, unless the user set a policy; once torch is in, it is too late."""
    code = ("import os, jobs, jobs.cli, jobs.plugin\n"
            "print(os.environ.get('OMP_WAIT_POLICY'))\n"
            "from jobs.process_env import set_omp_wait_policy\n"
            "print(set_omp_wait_policy(), os.environ.get('OMP_WAIT_POLICY'))\n")
    too_late = "import torch\nprint(set_omp_wait_policy())"  # in one process: the policy given plays no part
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in ((None, "None\nTrue PASSIVE\nFalse"), ("ACTIVE", "ACTIVE\nTrue ACTIVE")):
        done = subprocess.run([sys.executable, "-c", code + (too_late if given is None else "")], capture_output=True,
                              text=True, timeout=300, check=True,
                              env=env if given is None else {**env, "OMP_WAIT_POLICY": given})
        assert done.stdout.strip() == expected, done.stderr
