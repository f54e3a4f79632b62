"""Where and in which precision the engine runs: device and dtype probing, and the KV pool's size in blocks.

The engine's step loop (engine.llm_engine) takes these decisions as given; they live here so that the commands
that only probe (`tokenmill doctor`, preflight checks) need not build an engine, and so that sizing the KV pool is
one function of the model's shape, the config and the device's free memory (nano-vllm sizes its pool in the same
place it allocates it; vLLM's `determine_available_memory`).
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
from collections.abc import Sequence

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.core.kv_cache_spec import KVCacheSpec, layout_bytes_per_token, pool_blocks
from engine.kernels.cpu_features import cpu_flags_native_bf16, cpu_isa_cap
from engine.worker.device_choice import choose_device, choose_dtype
from engine.worker.host import CPU_KV_MEMORY_SHARE, cpu_kv_budget_bytes, memory_available_bytes

__all__ = ["CPU_KV_MEMORY_SHARE", "cpu_has_native_bf16", "cpu_kv_budget_bytes", "cpu_zeros", "device_name",
           "kv_block_bytes", "memory_available_bytes", "num_kv_blocks", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PAGE = 4096  # bytes


def resolve_device(device: str) -> torch.device:
    """torch.device for "auto" (cuda when available, else cpu) or an explicit name (engine.worker.device_choice's
    rule). Raises ValueError when cuda is asked for and not available."""
    return torch.device(choose_device(device, torch.cuda.is_available))


def device_name(device: torch.device) -> str:
    """What accounting calls `device`: "cpu", or the CUDA device's name (e.g. "NVIDIA H100 80GB HBM3")."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16: Intel Sapphire Rapids and later, AMD
    Zen 4 and later), so oneDNN's bf16 GEMMs run at 2-4x the fp32 rate; elsewhere bf16 is emulated and slower."""
    if cpu_isa_cap() is not None:  # ONEDNN_MAX_CPU_ISA: a smaller kind emulated; torch's probes see the whole CPU
        return cpu_flags_native_bf16()
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private probes, present since torch 2.3
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """torch dtype for an explicit name, or for "auto": bf16 on CUDA and on CPUs with native bf16
    (`cpu_has_native_bf16`), fp32 on other CPUs. An explicit bfloat16/float16 on a CPU without native bf16 runs
    (emulated, weights left unpacked where oneDNN cannot pack them) and logs a warning that float32 is faster here.
    The rule is engine.worker.device_choice's, which the client's checks follow without torch."""
    if dtype not in ("auto", "float32") and device.type == "cpu" and not cpu_has_native_bf16():
        _warn_once(f"--dtype {dtype} on a CPU without native bf16 (no AVX512-BF16/AMX): it runs emulated, slower "
                   "than float32; --dtype auto picks float32 here")
    return _DTYPES[choose_dtype(dtype, device.type, cpu_has_native_bf16)]


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


def cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor `shape` of `dtype` on its own private anonymous memory mapping (mmap(2)): the OS
    maps its pages as they are first written (reads see the shared zero page), so an auto-sized KV pool holds memory
    as its blocks are used, not all at load as torch.zeros (which writes every byte) would. Page-aligned, so rows of
    K and V (head_dim x itemsize bytes) never straddle a cache line more than they must. Not numpy.zeros (calloc):
    malloc may serve that from memory the process freed earlier, which calloc must clear, every page of it."""
    nbytes = math.prod(shape) * dtype.itemsize
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # numpy's view keeps the mapping alive (its base), torch's tensor the view; unmapped when both are gone.
    return torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=nbytes)).view(dtype).view(shape)


def kv_block_bytes(layout: Sequence[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block of `block_size` tokens takes across the layers of `layout` (the model's kv_cache_specs;
    K and V): block_size * the sum over layers of 2 * kv_heads * head_size * itemsize (0 for a layer without a
    cache)."""
    return layout_bytes_per_token(layout, dtype.itemsize) * block_size


def num_kv_blocks(model_config: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                  layout: Sequence[KVCacheSpec]) -> int:
    """KV blocks for the pool of `layout` (the model's kv_cache_specs) when config.num_kv_blocks is None: on CUDA,
    gpu_memory_utilization x the card's memory less what is in use (weights included), the logits of the largest
    step and CUDA graphs' scratch block; on the CPU, cpu_kv_budget_bytes (kv_cache_memory_bytes, or for "auto" half
    the memory available). Either way no more than max_num_seqs requests of max_model_len tokens could hold (all of
    that for a layout without a cache: its blocks cost nothing). Raises ValueError when not even one block fits."""
    per_block = kv_block_bytes(layout, config.block_size, dtype)
    if device.type == "cuda":
        from engine.worker.memory_fit import cuda_kv_budget_bytes

        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_kv_budget_bytes(total, free, config, model_config.vocab_size, per_block)
    else:
        budget = cpu_kv_budget_bytes(config)
    # No more than max_num_seqs requests of max_model_len tokens could ever hold: a small model on a big GPU
    # would otherwise take (and zero) most of the card's memory for blocks no schedule can use.
    max_len = min(config.max_model_len or model_config.max_position_embeddings,
                  model_config.max_position_embeddings)
    usable = config.max_num_seqs * -(-max_len // config.block_size)
    return pool_blocks(layout, config.block_size, dtype.itemsize, budget, usable)
