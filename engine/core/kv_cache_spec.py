"""The KV cache layout a model declares, one KVCacheSpec per layer, and the KV pool's sizes that follow from it.
Plain Python, no torch (the CLI's fit check reads it).

After vLLM's KVCacheSpec / FullAttentionSpec / SlidingWindowSpec (vllm/v1/kv_cache_interface.py): the model says
what each layer keeps per token; memory fit, the KV pool and the runner size and allocate from that, never from a
family name or ModelConfig's head counts. Every layer with a cache shares the pool's block ids (one block table per
request): block b of a request holds its tokens [b * block_size, (b + 1) * block_size) in every such layer, so a
block costs the sum of the layers' bytes and a sliding-window layer keeps every token as a full one does (its
attention reads only the last `window`). A layer of kind "none" (an encoder's, or a layer that reuses another's
cache) holds nothing; a model of such layers only takes no KV memory at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: What a layer keeps: "full" causal attention over every earlier token, "sliding" over the last `window` tokens,
#: "none" no KV cache.
KV_KINDS = ("full", "sliding", "none")


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV cache.

    Attributes:
        kind: one of KV_KINDS.
        num_kv_heads: key/value heads cached per token (0 for "none").
        head_size: width of one cached head, elements (0 for "none").
        window: the sliding window in tokens ("sliding" only; the query at i sees keys i - window < j <= i).

    Raises:
        ValueError: naming the field that does not fit the kind.
    """

    kind: str
    num_kv_heads: int = 0
    head_size: int = 0
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"KVCacheSpec.kind must be one of {KV_KINDS}, got {self.kind!r}")
        if self.kind == "none":
            if self.num_kv_heads or self.head_size or self.window is not None:
                raise ValueError(f"a KVCacheSpec of kind 'none' caches nothing; got num_kv_heads={self.num_kv_heads}"
                                 f", head_size={self.head_size}, window={self.window}")
            return
        if self.num_kv_heads < 1 or self.head_size < 1:
            raise ValueError(f"KVCacheSpec of kind {self.kind!r} needs num_kv_heads >= 1 and head_size >= 1, got "
                             f"{self.num_kv_heads} and {self.head_size}")
        if (self.kind == "sliding") != (self.window is not None):
            raise ValueError(f"KVCacheSpec.window is set for kind 'sliding' only (>= 1 tokens), got kind "
                             f"{self.kind!r} with window {self.window!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"KVCacheSpec.window must be >= 1 tokens, got {self.window}")

    @property
    def has_cache(self) -> bool:
        """Whether the layer keeps K/V in the pool."""
        return self.kind != "none"

    def block_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of this layer's K (and of its V) cache tensor of `num_blocks` blocks of `block_size` tokens:
        [num_blocks, block_size, num_kv_heads, head_size]; (0,) for a layer without a cache."""
        if not self.has_cache:
            return (0,)
        return (num_blocks, block_size, self.num_kv_heads, self.head_size)

    def bytes_per_token(self, itemsize: int) -> int:
        """Bytes one token takes in this layer (K and V) at `itemsize` bytes per element; 0 without a cache."""
        return 2 * self.num_kv_heads * self.head_size * itemsize


def full_attention(num_kv_heads: int, head_size: int, window: int | None = None) -> KVCacheSpec:
    """The spec of an attention layer of `num_kv_heads` heads of `head_size`: "sliding" when `window` is set, else
    "full"."""
    return KVCacheSpec("sliding" if window is not None else "full", num_kv_heads, head_size, window)


NO_KV_CACHE = KVCacheSpec("none")


def layout_bytes_per_token(layout: Sequence[KVCacheSpec], itemsize: int) -> int:
    """Bytes one token takes in the KV pool across the layers of `layout` (K and V) at `itemsize` bytes per
    element: 0 when no layer keeps a cache."""
    return sum(spec.bytes_per_token(itemsize) for spec in layout)


def pool_blocks(layout: Sequence[KVCacheSpec], block_size: int, itemsize: int, budget_bytes: int,
                usable_blocks: int) -> int:
    """Blocks of `block_size` tokens the KV pool of `layout` takes from `budget_bytes`, at most `usable_blocks`
    (what max_num_seqs sequences of max_model_len could ever hold). A layout without a cache costs nothing per
    block: it gets `usable_blocks` (block tables, never memory). Raises ValueError when not even one block fits."""
    per_block = layout_bytes_per_token(layout, itemsize) * block_size
    if per_block == 0:
        return usable_blocks
    if budget_bytes < per_block:
        raise ValueError(f"no memory left for the KV cache ({budget_bytes} bytes, one block needs {per_block}); "
                         "raise gpu_memory_utilization / kv_cache_memory_bytes or use a smaller model")
    return min(budget_bytes // per_block, usable_blocks)
