"""Block pool and block tables: allocation, ref counts, freeing, integrity. Plain Python, no model."""

from __future__ import annotations

import pytest

from engine.core.kv_cache_manager import BlockPool, KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams


def _req(rid: str, n_prompt: int, first: int = 100) -> Request:
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams())


def test_pool_allocate_free_and_refcounts() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 5
    assert all(pool.ref_counts[b] == 1 for b in a)
    pool.touch(a[0])
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
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_slots_grows_table_block_by_block() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = _req("a", 6)
    table = kv.allocate_slots(r, 6)
    assert table is not None and len(table) == 2  # 6 tokens -> 2 blocks of 4
    table = list(table)  # a snapshot: the manager grows its own list in place
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 1) == table  # token 7 fits in block 2
    r.num_computed_tokens = 7
    assert kv.allocate_slots(r, 1) == table  # token 8 still fits
    r.num_computed_tokens = 8
    grown = kv.allocate_slots(r, 1)
    assert grown is not None and len(grown) == 3 and grown[:2] == table
    assert grown is kv.block_tables["a"]  # the same list, one block longer (engine.worker.input_batch relies on it)
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


def _prefill(kv: KVCacheManager, r: Request) -> list[int]:
    """Admit `r` as the scheduler does and mark its prompt computed."""
    hits = kv.get_computed_blocks(r)
    table = kv.allocate_slots(r, r.num_tokens - len(hits) * kv.block_size, hits)
    assert table is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return table


def test_prefix_cache_shares_full_blocks_of_a_common_prefix() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = _req("a", 10)  # blocks [0-3] [4-7] [8-9]
    table_a = _prefill(kv, a)
    b = Request("b", a.prompt_token_ids[:8] + [7, 7, 7], SamplingParams())  # same first 8 tokens
    hits = kv.get_computed_blocks(b)
    assert hits == table_a[:2]
    table_b = kv.allocate_slots(b, 3, hits)
    assert table_b is not None and table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    # The manager reads requests, never writes them: the scheduler advances b past its 8 cached tokens.
    assert b.num_computed_tokens == 0
    assert kv.pool.ref_counts[table_a[0]] == 2
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 20
    kv.check_integrity()


def test_prefix_cache_keeps_freed_blocks_until_evicted_and_leaves_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _req("a", 8)
    table_a = _prefill(kv, a)
    kv.free(a)
    # Same 8 tokens again: only the first block can be reused, the last token must be computed for its logits.
    again = _req("again", 8)
    assert kv.get_computed_blocks(again) == table_a[:1]
    # A different prompt needs the whole pool: the cached blocks are evicted and the lookup misses.
    other = _req("other", 24, first=500)
    assert kv.allocate_slots(other, 24) is not None
    assert kv.get_computed_blocks(again) == []
    assert not kv.pool.cached or all(kv.pool.block_hash[b] is not None for b in kv.pool.cached.values())
    kv.check_integrity()


def test_prefix_cache_off_shares_nothing() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=False)
    a = _req("a", 10)
    _prefill(kv, a)
    assert kv.get_computed_blocks(_req("b", 10)) == []
