"""KV block bookkeeping: a ref-counted block pool and per-request block tables. Plain Python, no torch.

Source: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention" (SOSP 2023),
§4.2-4.3; names follow vLLM v1 (vllm/v1/core: BlockPool, KVCacheManager.allocate_slots).
"""

from __future__ import annotations

from collections import deque

from engine.request import Request


class BlockPool:
    """A fixed set of KV blocks with reference counts and a free queue.

    Block ids are 0..num_blocks-1. Raises ValueError on num_blocks < 1, RuntimeError on double free or when
    allocating from an empty pool (callers check `num_free_blocks` first).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each). Raises RuntimeError when fewer than n are free."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free; check num_free_blocks first")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, block_id: int) -> None:
        """Share a block that already has an owner (prefix caching, forks)."""
        if self.ref_counts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is free; cannot share it")
        self.ref_counts[block_id] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 goes back to the free queue."""
        # Freed in reverse so a request's tail blocks are reused first and its head blocks stay longest.
        for b in reversed(blocks):
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        """Raise RuntimeError if the free queue and the ref counts disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a block is in the free queue twice")
        for b, rc in enumerate(self.ref_counts):
            if rc < 0 or (rc == 0) != (b in free):
                raise RuntimeError(f"block {b}: ref count {rc} but {'in' if b in free else 'not in'} free queue")


class KVCacheManager:
    """Per-request block tables over a `BlockPool`.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Reserve KV slots for `num_new_tokens` more tokens of `request` (beyond its num_computed_tokens).

        Returns the request's block table (block ids, in order) or None when the pool cannot fit them; the caller
        then preempts. Raises ValueError if num_new_tokens < 1. Source: PagedAttention (SOSP 2023), §4.2.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        table = self.block_tables.get(request.request_id, [])
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(table)
        if need > self.pool.num_free_blocks:
            return None
        if need > 0:
            table = table + self.pool.allocate(need)
        self.block_tables[request.request_id] = table
        return table

    def free(self, request: Request) -> None:
        """Release every block of `request` (finished or preempted)."""
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
