"""Block pool and block tables: allocation, ref counts, freeing, integrity. Plain Python, no model."""

from __future__ import annotations

import pytest

from engine.kv_cache_manager import BlockPool, KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def _req(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(), 0)


def test_pool_allocate_free_and_refcounts() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 5
    assert all(pool.ref_counts[b] == 1 for b in a)
    pool.incref(a[0])
    pool.free(a)
    assert pool.ref_counts[a[0]] == 1 and pool.num_free_blocks == 7  # shared block survives one free
    pool.free([a[0]])
    assert pool.num_free_blocks == 8
    pool.check_integrity()


def test_pool_errors() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="asked for 3"):
        pool.allocate(3)
    b = pool.allocate(1)
    pool.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(b)
    with pytest.raises(RuntimeError, match="is free"):
        pool.incref(b[0])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_slots_grows_table_block_by_block() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = _req("a", 6)
    table = kv.allocate_slots(r, 6)
    assert table is not None and len(table) == 2  # 6 tokens -> 2 blocks of 4
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 1) == table  # token 7 fits in block 2
    r.num_computed_tokens = 7
    assert kv.allocate_slots(r, 1) == table  # token 8 still fits
    r.num_computed_tokens = 8
    grown = kv.allocate_slots(r, 1)
    assert grown is not None and len(grown) == 3 and grown[:2] == table
    kv.check_integrity()
    kv.free(r)
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_allocate_slots_returns_none_when_full_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = _req("a", 8), _req("b", 8)
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(b, 8) is None
    assert "b" not in kv.block_tables and kv.num_free_blocks == 1
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 0)
    kv.check_integrity()
