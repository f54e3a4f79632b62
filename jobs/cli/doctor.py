"""`tokenmill doctor`: what this machine is and what the engine's defaults pick on it, and why.

A user filing a bug pastes its output; a user choosing a CPU fleet reads which path each CPU kind gets. Everything
is probed, not assumed: the CPU's flags from /proc/cpuinfo, oneDNN's bf16 packing and int8 GEMM by running them once
(engine.quant.packed_linear.bf16_packing_available, engine.quant.int8_linear.int8_weight_qmax), the C++ kernels by
building
or loading them (engine.kernels.cpu_kernels.cpu_ops: about 15 s the first time on a machine, then cached).
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.kernels.cpu_features import cpu_flags, cpu_isa_cap

# The CPU features that change which path the engine takes (engine.llm_engine, engine.quant.packed_linear,
# engine.quant.int8_linear), in the spelling of /proc/cpuinfo.
CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(CPU model name, set of flags) from /proc/cpuinfo, the flags capped where ONEDNN_MAX_CPU_ISA sets a cap
    (engine.kernels.cpu_features.cpu_flags); ("", empty) where there is none (not Linux)."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
                break
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), cpu_flags()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def model_report(model: str | None) -> dict[str, Any]:
    """The family and shape of `model` (a local GGUF file or model folder, a URL or hub id as --model takes it;
    None: the default model), from its header only: {path, family, summary, experts, experts_active} (experts None
    for a dense model), or {path, error} when it cannot be read or tokenmill does not run it. Never raises."""
    from engine.loading.model_files import default_model_path, local_model_path
    from engine.loading.quantized import read_model_config
    from engine.model.architectures import describe

    try:
        path = default_model_path() if model is None else local_model_path(model)
        cfg = read_model_config(path)
    except (OSError, ValueError) as e:
        return {"path": model or "default", "error": str(e)}
    return {"path": path, "family": cfg.architecture, "summary": describe(cfg),
            "experts": cfg.num_experts or None, "experts_active": cfg.num_experts_per_tok or None}


def machine_report(model: str | None = None) -> dict[str, Any]:
    """The machine and the engine's default choices on it, and the family of `model` (model_report; None = the
    default model), as a JSON-ready dict.

    Keys: cpu {model, features (of CPU_FEATURES, present ones), cores, threads_for_torch, omp_wait_policy},
    memory_gib {total, available, available_to_process}, gpus [{name, memory_gib}], versions {python, torch,
    transformers, tokenizers, gguf, triton, tokenmill}, kernels {cpp_kernels, onednn, bf16_packing, int8_gemm,
    int8_weight_bits}, defaults {device, dtype, dtype_reason, attention_backend, cpu_kv_cache_gib,
    cpu_kv_cache_reason, default_model, small_batch_kernel}, model (model_report).
    Never raises for a missing piece: it is reported as such.
    """
    import psutil
    import torch

    from engine.config import EngineConfig
    from engine.kernels.cpu_kernels import cpu_ops
    from engine.loading.model_files import default_model_path
    from engine.quant.int8_linear import int8_available, int8_weight_qmax
    from engine.quant.packed_linear import bf16_packing_available, packing_available
    from engine.worker.device import (
        cpu_has_native_bf16,
        cpu_kv_budget_bytes,
        memory_available_bytes,
        resolve_device,
        resolve_dtype,
    )
    from engine.worker.model_runner import select_attention

    cpu_model, flags = _cpuinfo()
    mem = psutil.virtual_memory()
    gpus = [{"name": torch.cuda.get_device_name(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    native_bf16 = cpu_has_native_bf16()
    if device.type == "cuda":
        reason = "bfloat16 on CUDA"
    elif native_bf16:
        reason = "this CPU computes bf16 natively (AVX512-BF16 or AMX): bf16 GEMMs run at 2-4x the fp32 rate"
    else:
        reason = "this CPU has no native bf16 (no AVX512-BF16/AMX): bf16 would be emulated, slower than float32"
    try:
        default_model: str | None = default_model_path()
    except FileNotFoundError as e:
        default_model = f"missing: {e}"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    int8 = int8_available()
    report = {
        "cpu": {"model": cpu_model, "features": [f for f in CPU_FEATURES if f in flags], "cores": cores,
                "threads_for_torch": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (libgomp spins at barriers)"),
                "torch_capability": torch.backends.cpu.get_cpu_capability(),
                "isa_cap": cpu_isa_cap()},
        "memory_gib": {"total": round(mem.total / 2**30, 1), "available": round(mem.available / 2**30, 1),
                       "available_to_process": round(memory_available_bytes() / 2**30, 1)},
        "gpus": gpus,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     **{d: _version(d) for d in ("transformers", "tokenizers", "gguf", "triton", "tokenmill")}},
        "kernels": {"cpp_kernels": cpu_ops() is not None, "onednn": packing_available(),
                    "bf16_packing": bf16_packing_available(), "int8_gemm": int8,
                    "int8_weight_bits": (8 if int8_weight_qmax() == 127.0 else 7) if int8 else None},
        "defaults": {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "dtype_reason": reason,
                     "attention_backend": select_attention("auto", device).__name__,
                     "cpu_kv_cache_gib": round(cpu_kv_budget_bytes(EngineConfig()) / 2**30, 2),
                     "cpu_kv_cache_reason": "half the memory available to this process now (cgroup limit included); "
                                            "a worker sizes it after its model loads; --kv-cache-gib fixes it",
                     "default_model": default_model,
                     "small_batch_kernel": _small_batch_kernel(device, dtype)},
        "model": model_report(model),
    }
    return report


def _small_batch_kernel(device: Any, dtype: Any) -> str:
    """What engine.quant.packed_linear's small-batch path does here (its module docstring says why)."""
    import torch

    from engine.quant.packed_linear import gguf_kernel_max_rows

    if device.type != "cpu" or dtype != torch.float32:
        return f"off: the {str(dtype).removeprefix('torch.')} path on {device.type} reads its own weights"
    max_rows = gguf_kernel_max_rows()
    if max_rows <= 0:
        return "off (TOKENMILL_GGUF_KERNEL=0)"
    return (f"decode steps of <= {max_rows} rows without a seeded row read a GGUF's Q4_0/Q4_1/Q8_0/Q4_K "
            "blocks (0.75-1.1 bytes per weight instead of fp32's 4; the same weights), other steps the packed GEMMs")
