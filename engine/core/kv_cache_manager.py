"""KV block bookkeeping: a ref-counted block pool, per-request block tables, prefix caching. Plain Python, no torch.

Sources: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention" (SOSP 2023),
§4.2-4.3; automatic prefix caching as in vLLM v1 (vllm/v1/core: BlockPool, KVCacheManager.allocate_slots; blocks
hashed as a chain of parent hash + token ids, and the mm hashes of the images a block holds) and SGLang's
RadixAttention (Zheng et al., 2024).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from engine.core.request import Request


class BlockPool:
    """A fixed set of KV blocks with reference counts, a free queue, and a map of cached full blocks.

    A block whose ref count drops to 0 goes to the back of the free queue but keeps its hash, so a later request
    with the same prefix can take it back (a prefix-cache hit); it is evicted (hash dropped) only when the queue
    hands it out again, least recently freed first.

    Block ids are 0..num_blocks-1. Raises ValueError on num_blocks < 1, RuntimeError on double free or when
    allocating from an empty pool (callers check `num_free_blocks` first).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[Hashable, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_cache_hits = 0  # blocks reused, over the pool's life

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached or not)."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each), evicting their cached hashes. Raises RuntimeError when fewer
        than n are free."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free; check num_free_blocks first")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                del self.cached[h]
                self.block_hash[b] = self.block_tokens[b] = None
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, block_id: int) -> None:
        """Take one more reference to a block (a prefix-cache hit), taking it off the free queue if needed."""
        if self.ref_counts[block_id] == 0:
            del self._free[block_id]
        self.ref_counts[block_id] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 goes back to the free queue."""
        # Freed in reverse so a request's tail blocks are evicted before its head blocks, which other requests
        # are likelier to share.
        for b in reversed(blocks):
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def cache_block(self, block_id: int, block_hash: int, tokens: tuple[Hashable, ...]) -> None:
        """Register a full, computed block under its chain hash (first writer wins); `tokens`: its key (token ids,
        then the mm hashes of the images it holds: KVCacheManager._block_tokens)."""
        if self.block_hash[block_id] is None and block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash
            self.block_tokens[block_id] = tokens

    def lookup(self, block_hash: int, tokens: tuple[Hashable, ...]) -> int | None:
        """The cached block holding exactly `tokens` after the same prefix, or None. Token ids are compared, so a
        hash collision can never return a wrong block."""
        b = self.cached.get(block_hash)
        return b if b is not None and self.block_tokens[b] == tokens else None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash (blocks in use keep their data; nothing is freed). Returns the number of
        hashes dropped. Later requests start cold, as on a fresh engine: for benchmarks that rerun the same
        prompts, and after the model's weights change."""
        dropped = len(self.cached)
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        return dropped

    def check_integrity(self) -> None:
        """Raise RuntimeError if the free queue, ref counts and cache map disagree."""
        for b, rc in enumerate(self.ref_counts):
            if rc < 0 or (rc == 0) != (b in self._free):
                raise RuntimeError(f"block {b}: ref count {rc} but {'in' if b in self._free else 'not in'} free queue")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                raise RuntimeError(f"cache map says block {b} has hash {h}, the block says {self.block_hash[b]}")


def chain_hash(parent: Hashable, tokens: tuple[Hashable, ...]) -> int:
    """Hash of a full block given its parent's hash (a first block's: None or its request's salt): equal only for
    equal prefixes (up to collisions, which `BlockPool.lookup` rules out by comparing tokens)."""
    return hash((parent, tokens))


class KVCacheManager:
    """Per-request block tables over a `BlockPool`, with optional prefix caching.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks of identical prefixes between requests.
        cache_salt: a request's salt (any hashable), the parent hash of its first block: blocks are shared only
            between requests of equal salts. For KV that depends on more than the tokens before it (LongRoPE's
            factor set follows the prompt's length: engine.layers.rope.longrope_table_rows). None = no salt.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_salt: Callable[[Request], Hashable] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_salt = cache_salt
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # leading full blocks of each request registered in the cache
        # NOTE: the chain hashes of each request's full blocks live here, not on the request: the scheduler owns
        # request state. Dropped when the request's blocks are freed (finished, preempted or aborted); a preempted
        # request hashes its blocks again when it is looked up next (a few hashes, once per preemption).
        self._hashes: dict[str, list[int]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, request: Request, i: int) -> tuple[Hashable, ...]:
        """Block i's key: its token ids, then the mm hash of every image whose placeholders it holds (their tokens
        are the same placeholder id for every image: the hash tells the images apart, vLLM v1's extra keys)."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        tokens = tuple(request.all_token_ids[start:end])
        items = request.mm_items
        if items and start < items[-1].end:
            extra = tuple(item.mm_hash for item in items if item.offset < end and item.end > start)
            if extra:
                return tokens + extra
        return tokens

    def block_hashes(self, request: Request, num_blocks: int | None = None) -> list[int]:
        """Chain hashes of `request`'s first `num_blocks` full blocks (default: every full block but one holding
        the last token, whose logits are always computed: the blocks a prefix-cache lookup may match). Kept per
        request id in the manager (as vLLM v1 keeps `block_hashes` per request) and extended as its tokens grow, so
        each block is hashed once while the request holds blocks. Raises ValueError when fewer than `num_blocks`
        blocks are full."""
        if num_blocks is None:
            num_blocks = (request.num_tokens - 1) // self.block_size
        if num_blocks * self.block_size > request.num_tokens:
            raise ValueError(f"request {request.request_id!r} has {request.num_tokens} tokens, fewer than "
                             f"{num_blocks} full blocks of {self.block_size}")
        hashes = self._hashes.setdefault(request.request_id, [])
        parent = hashes[-1] if hashes else (self.cache_salt(request) if self.cache_salt is not None else None)
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, self._block_tokens(request, i))
            hashes.append(parent)
        return hashes[:num_blocks]

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of `request`'s tokens (leading full blocks, in order; empty when prefix
        caching is off). At least the last token is always left to compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i, h in enumerate(self.block_hashes(request)):
            b = self.pool.lookup(h, self._block_tokens(request, i))
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Reserve KV slots for `num_new_tokens` more tokens of `request` (beyond its num_computed_tokens plus the
        tokens of `computed_blocks`, prefix-cache hits from `get_computed_blocks` for a request with no blocks yet).

        Returns the request's block table (block ids, in order: the manager's own list, which later allocations
        extend in place; copy it to keep a snapshot) or None when the pool cannot fit them; the caller then
        preempts. Reads the request, never writes it: on success with hits the scheduler advances
        num_computed_tokens past them.
        Raises ValueError if num_new_tokens < 1. Source: PagedAttention (SOSP 2023), §4.2.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        table = self.block_tables.get(request.request_id)
        if table is not None and not computed_blocks:
            # The decode path: most steps the request's last block still has room.
            if request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
                return table
        else:
            table = table or []
        computed_blocks = computed_blocks or []
        if computed_blocks and table:
            raise ValueError("computed_blocks are only for a request that holds no blocks yet")
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed_blocks)
        # Hits still on the free queue stop being free once taken.
        reclaimed = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if need + reclaimed > self.pool.num_free_blocks:
            return None
        for b in computed_blocks:
            self.pool.touch(b)
        self.pool.num_cache_hits += len(computed_blocks)
        if computed_blocks or not table:
            table = table + computed_blocks
            self.block_tables[request.request_id] = table
        if need > 0:
            # NOTE: grown in place: the model runner's persistent block table copies only the blocks past the ones
            # it holds (engine.worker.input_batch), so a table is only ever appended to while the request holds it.
            table.extend(self.pool.allocate(need))
        if computed_blocks:
            self._num_cached[request.request_id] = len(computed_blocks)
        return table

    def cache_full_blocks(self, request: Request) -> None:
        """Register `request`'s newly computed full blocks for reuse (call after its num_computed_tokens moved)."""
        if not self.enable_prefix_caching:
            return
        done = self._num_cached.get(request.request_id, 0)
        full = request.num_computed_tokens // self.block_size
        if full <= done:
            return
        table = self.block_tables[request.request_id]
        hashes = self.block_hashes(request, full)
        for i in range(done, full):
            self.pool.cache_block(table[i], hashes[i], self._block_tokens(request, i))
        self._num_cached[request.request_id] = full

    def free(self, request: Request) -> None:
        """Release every block of `request` (finished or preempted); cached blocks stay reusable until evicted."""
        self._num_cached.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.free(table)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request."""
        return self.pool.num_free_blocks

    def check_integrity(self) -> None:
        """Raise RuntimeError if ref counts do not equal the number of tables holding each block."""
        self.pool.check_integrity()
        counts = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                counts[b] += 1
        if counts != self.pool.ref_counts:
            raise RuntimeError("KV block ref counts disagree with the block tables")
