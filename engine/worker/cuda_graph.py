"""CUDA graphs for decode steps at bucketed batch sizes.

A decode step of a small model is dozens of tiny kernels per layer; launching them costs more than running them.
Capturing the step once per batch-size bucket and replaying it removes the launch cost (as vLLM and SGLang do).
Source: NVIDIA, "CUDA Graphs" (CUDA C++ Programming Guide); torch.cuda.CUDAGraph.

NOTE: a captured step reads only device tensors of fixed shape. Attention under capture sees `seq_lens_host` set to
the upper bound (max_model_len) for every row, so kernels that size their grid from host lengths size it for the
worst case and mask by the device `seq_lens`. Padded rows write their K/V to a scratch block no request owns.
"""

from __future__ import annotations

import torch

from engine.layers.attention import AttentionMetadata
from engine.layers.self_attn import AttentionFn
from engine.model.base import ModelBase


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every 8 up to max_num_seqs (a step of n requests runs in the smallest bucket >= n)."""
    sizes = [b for b in (1, 2, 4) if b <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured decode steps, one per bucket, sharing one memory pool and one set of static inputs.

    Args:
        model: the decoder.
        attn_fn: its paged attention; must be capturable (no host syncs, grid from the NOTE above).
        kv_caches: the per-layer (k_cache, v_cache) tensors, [num_blocks + 1, block_size, kv_heads, head_size]
            each as the model's kv_cache_specs lay them out (empty for a layer without a cache).
        block_size: tokens per KV block.
        scratch_block: the block padded graph rows write to (the pool's last: num_blocks).
        max_num_seqs: the largest bucket.
        max_blocks_per_seq: width of the static block table (max_model_len / block_size, rounded up).
        max_model_len: upper bound of any sequence length, in tokens.
    """

    def __init__(self, model: ModelBase, attn_fn: AttentionFn, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, scratch_block: int, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int) -> None:
        self.model = model
        self.attn_fn = attn_fn
        self.kv_caches = kv_caches
        self.device = kv_caches[0][0].device  # an empty cache (a layer without one) is on the device too
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        dev = self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.rope_rows = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_block * self.block_size, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, max_blocks_per_seq), self.scratch_block, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], query_lens=[1] * b,
            seq_lens_host=[self.max_model_len] * b, decode_only=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, so smaller ones reuse its memory pool."""
        pool = None
        for b in reversed(self.sizes):
            args = (self.input_ids[:b], self.rope_rows[:b], self.kv_caches, self._meta(b), self.attn_fn)
            torch.cuda.synchronize(self.device)
            self.model(*args)  # warm-up: autotuning and lazy inits happen outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model(*args)
            pool = graph.pool()
            self.graphs[b] = graph

    def bucket(self, n: int) -> int | None:
        """The bucket a decode step of n requests runs in, or None when n exceeds the largest."""
        return next((b for b in self.sizes if b >= n), None)

    def run(self, input_ids: torch.Tensor, rope_rows: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the step for n = len(input_ids) decode requests; returns hidden states [n, hidden] (a view into
        the graph's output buffer, valid until the next replay)."""
        n = input_ids.shape[0]
        b = self.bucket(n)
        if b is None or b not in self.graphs:
            raise ValueError(f"no captured graph for a decode batch of {n}; capture() first or run eagerly")
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.rope_rows[:n].copy_(rope_rows, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        # Padded rows: length 1 in the scratch block, so they read and write nothing a request owns.
        self.slot_mapping[n:b].fill_(self.scratch_block * self.block_size)
        self.seq_lens[n:b].fill_(1)
        self.block_tables[n:b, 0].fill_(self.scratch_block)
        self.graphs[b].replay()
        return self.outputs[b][:n]
