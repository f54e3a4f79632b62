"""The KV pool's size on the CPU (engine.worker.device; its budget engine.worker.host.cpu_kv_budget_bytes): "auto" is
half the memory free to the process (a cgroup limit and a Dask worker's memory limit count), capped by what the batch
could ever hold, and its pages are taken as blocks are first written. A fixed 1 GiB preempted and recomputed rows at
256 GSM8K rows (bench/README.md "KV pool on the CPU")."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from engine import EngineConfig
from engine.config import ModelConfig
from engine.model.registry import kv_cache_layout
from engine.worker import device as dev
from engine.worker import host

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64: 46,080 bytes of fp32 K and V per token.
SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, max_position_embeddings=8192)
LAYOUT = kv_cache_layout(SMOL)
CPU = torch.device("cpu")


def test_auto_pool_is_half_the_free_memory_capped_by_what_the_batch_can_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    per_block = dev.kv_block_bytes(LAYOUT, 16, torch.float32)
    assert per_block == 16 * 46_080
    monkeypatch.setattr(host, "memory_available_bytes", lambda: 8 << 30)
    blocks = dev.num_kv_blocks(SMOL, EngineConfig(device="cpu"), CPU, torch.float32, LAYOUT)
    assert blocks == (4 << 30) // per_block  # 5,825 blocks: 93,200 tokens, 364 rows of 256 tokens
    # A fixed size is taken as given; the batch's ceiling (max_num_seqs x max_model_len) caps either.
    assert dev.num_kv_blocks(SMOL, EngineConfig(device="cpu", kv_cache_memory_bytes=1 << 30), CPU,
                             torch.float32, LAYOUT) == (1 << 30) // per_block
    small = EngineConfig(device="cpu", max_num_seqs=4, max_model_len=256)
    assert dev.num_kv_blocks(SMOL, small, CPU, torch.float32, LAYOUT) == 4 * 256 // 16


def test_a_worker_memory_limit_bounds_the_auto_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "memory_available_bytes", lambda: 64 << 30)
    rss = psutil.Process().memory_info().rss
    limited = EngineConfig(device="cpu", memory_limit_bytes=rss + (2 << 30))
    budget = host.cpu_kv_budget_bytes(limited)
    assert (1 << 30) - (64 << 20) <= budget <= 1 << 30  # half of the ~2 GiB the process does not hold yet
    assert host.cpu_kv_budget_bytes(EngineConfig(device="cpu")) == 32 << 30


@pytest.mark.parametrize(("limit", "usage", "expected"), [
    ("4294967296\n", "1073741824\n", 3 << 30),  # v2: memory.max - memory.current
    ("max\n", "1073741824\n", None),  # v2 without a limit
])
def test_cgroup_v2_headroom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, usage: str,
                            expected: int | None) -> None:
    (tmp_path / "memory.max").write_text(limit)
    (tmp_path / "memory.current").write_text(usage)
    monkeypatch.setattr(host, "_CGROUP", tmp_path)
    assert host._cgroup_headroom_bytes() == expected
    if expected is not None:  # the OS's MemAvailable below and above the cgroup's headroom (not this machine's now)
        for available in (2 << 30, 8 << 30):
            monkeypatch.setattr(psutil, "virtual_memory", lambda a=available: SimpleNamespace(available=a))
            assert host.memory_available_bytes() == min(expected, available)


def test_cgroup_v1_headroom_and_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "_CGROUP", tmp_path)
    assert host._cgroup_headroom_bytes() is None
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(2 << 30))
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(str(512 << 20))
    assert host._cgroup_headroom_bytes() == (2 << 30) - (512 << 20)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    assert host._cgroup_headroom_bytes() is None


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s pages resident in memory, by mincore(2) over exactly its (page-aligned) range."""
    import ctypes

    nbytes = tensor.numel() * tensor.element_size()
    pages = -(-nbytes // dev.PAGE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * dev.PAGE


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as Linux has it")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_zeros_are_zeros_whose_pages_come_on_first_write(dtype: torch.dtype) -> None:
    """The pool's own pages (not the process's RSS, which other allocations move) are not resident before a write,
    whatever memory the process freed before (numpy.zeros, i.e. calloc, once came back with every page resident in
    a CI run)."""
    shape = (4096, 16, 8, 64)  # 32 Mi elements: 64-128 MiB
    pool = dev.cpu_zeros(shape, dtype)
    nbytes = pool.numel() * pool.element_size()
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % dev.PAGE == 0  # page-aligned: K/V rows on cache-line boundaries
    assert _resident_bytes(pool) == 0, "pages resident before any write"
    pool[7].fill_(1.5)
    assert 0 < _resident_bytes(pool) < nbytes // 4  # only the written row's pages (and THP's rounding)
    assert pool[7].eq(1.5).all() and pool[:7].eq(0).all() and pool[8:].eq(0).all()  # reading maps zero pages
