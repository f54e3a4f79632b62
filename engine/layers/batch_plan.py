"""How the torch path of paged attention (engine.layers.attention.paged_attention_ref) batches one step, and the
masks it builds: causal, sliding-window, and bidirectional within an image's placeholders.

Bidirectional image attention (Gemma 3; Gemma Team, "Gemma 3 Technical Report", 2025): in prefill the placeholders of
one image see each other, an earlier one the later ones too, as HF transformers' Gemma 3 mask: OR(causal, same
image) on the global layers, AND(window, OR(causal, same image)) on the sliding ones (create_masks_for_vision_model,
blockwise_overlay). Since an image's placeholders are contiguous, a query inside image [start, end) sees exactly the
keys up to end - 1 (its causal keys and the rest of its image): its key limit, where another query's is its own
position; the window's lower bound stays at the query's position. AttentionMetadata.image_spans lists the images of
a step's prefill chunks; each chunk holds its images up to their last placeholder (engine.core.scheduler), so every
key a query may see is in the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class StepLayout(Protocol):
    """What a plan reads of a step (engine.layers.attention.AttentionMetadata's fields of these names)."""

    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens_host: list[int]
    image_spans: tuple[tuple[int, int, int], ...]


def key_limits(pos: torch.Tensor, prefill: Sequence[int], spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """The last key position each prefill query sees, int64 [P, max_q]: its position pos [P, max_q], or end - 1 for
    a query at a position in [start, end) of a span (request b, start, end) of `spans` whose request is prefill
    row i (b = prefill[i]). Spans of requests outside `prefill` (one-token chunks, whose query is causal) are
    skipped."""
    if not spans:
        return pos
    limit = pos.clone()
    row = {b: i for i, b in enumerate(prefill)}
    for b, start, end in spans:
        i = row.get(b)
        if i is not None:
            inside = (pos[i] >= start) & (pos[i] < end)
            limit[i] = torch.where(inside, end - 1, limit[i])
    return limit


@dataclass
class BatchPlan:
    """How the torch path batches one step: every decode row in one attention call, every prefill chunk in another.

    Built once per step (`AttentionMetadata.batch_plan`) from the host lists and reused by every layer, so no
    layer loops over requests in Python. Each group reads its requests' contexts through one gather of whole KV
    blocks (`block_ids`, padded with block 0 to the group's longest context) and masks what a query may not see
    with an additive mask (0 or -inf) of the attention dtype.

    Attributes:
        decode_rows: rows of q (and requests) of the decode group: a slice when they lead the step (the model
            runner orders decodes first), else an int64 index tensor; None when the step has no decode row.
        decode_block_ids: int64 [Bd * nb_d], the decode requests' block tables flattened.
        decode_mask: [Bd, 1, 1, nb_d * block_size] additive mask (keys past each request's seq_len are -inf, and
            with a sliding window W the keys before seq_len - W too).
        prefill_rows: int64 [Tp], the rows of q fed by prefill chunks, request by request; None without prefill.
        prefill_block_ids: int64 [P * nb_p].
        prefill_pad_index: int64 [Tp], where each prefill row sits in the padded [P * max_q_len] query batch.
        prefill_mask: [P, 1, max_q_len, nb_p * block_size] additive causal mask (sliding-window causal when
            `sliding_window` is set), a query inside one of the step's image spans (AttentionMetadata.image_spans)
            seeing every key of its image (key_limits); a padded query row sees key 0 (its output is discarded) so
            no row of the softmax is empty.
        max_q_len: the longest prefill chunk (tokens).
        sliding_window: the window W the masks were built for (None: full causal).
    """

    decode_rows: slice | torch.Tensor | None
    decode_block_ids: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefill_rows: torch.Tensor | None
    prefill_block_ids: torch.Tensor | None
    prefill_pad_index: torch.Tensor | None
    prefill_mask: torch.Tensor | None
    max_q_len: int
    sliding_window: int | None = None

    @classmethod
    def build(cls, meta: StepLayout, block_size: int, dtype: torch.dtype,
              sliding_window: int | None = None) -> BatchPlan:
        """The plan of `meta`'s step for KV blocks of `block_size` tokens, attention in `dtype` and a sliding
        window of `sliding_window` keys (None: full causal)."""
        device = meta.block_tables.device
        decode = [b for b, n in enumerate(meta.query_lens) if n == 1]
        prefill = [b for b, n in enumerate(meta.query_lens) if n > 1]
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)

        def blocks(reqs: list[int]) -> tuple[torch.Tensor, int, torch.Tensor]:
            seq = [meta.seq_lens_host[b] for b in reqs]
            nb = -(-max(seq) // block_size)
            idx = torch.tensor(reqs, device=device)
            ids = meta.block_tables.index_select(0, idx)[:, :nb].long().reshape(-1)
            return ids, nb, torch.tensor(seq, device=device)

        decode_rows = decode_ids = decode_mask = None
        if decode:
            decode_ids, nb, seq = blocks(decode)
            keys = torch.arange(nb * block_size, device=device)
            visible = keys[None, :] < seq[:, None]
            if sliding_window is not None:  # the decode query sits at seq_len - 1 and sees keys > seq_len - 1 - W
                visible &= keys[None, :] >= (seq - sliding_window)[:, None]
            decode_mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            decode_mask = decode_mask[:, None, None, :]
            contiguous = decode == list(range(len(decode))) and starts[len(decode)] == len(decode)
            decode_rows = slice(0, len(decode)) if contiguous else torch.tensor(
                [starts[b] for b in decode], device=device)
        prefill_rows = prefill_ids = pad_index = prefill_mask = None
        max_q = 0
        if prefill:
            prefill_ids, nb, seq = blocks(prefill)
            q_lens = [meta.query_lens[b] for b in prefill]
            max_q = max(q_lens)
            prefill_rows = torch.tensor([r for b in prefill for r in range(starts[b], starts[b + 1])], device=device)
            pad_index = torch.tensor([i * max_q + j for i, n in enumerate(q_lens) for j in range(n)], device=device)
            q_len = torch.tensor(q_lens, device=device)
            j = torch.arange(max_q, device=device)
            keys = torch.arange(nb * block_size, device=device)
            # Query j of request i sits at position seq_len - q_len + j and sees keys up to it (up to its image's
            # last one inside an image span), within the window of its position.
            pos = (seq - q_len)[:, None] + j[None, :]  # [P, max_q]
            visible = keys[None, None, :] <= key_limits(pos, prefill, meta.image_spans)[:, :, None]
            if sliding_window is not None:
                visible &= keys[None, None, :] > (pos - sliding_window)[:, :, None]
            visible |= (j[None, :] >= q_len[:, None])[:, :, None] & (keys == 0)[None, None, :]
            prefill_mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            prefill_mask = prefill_mask[:, None]
        return cls(decode_rows, decode_ids, decode_mask, prefill_rows, prefill_ids, pad_index, prefill_mask, max_q,
                   sliding_window)

