"""Multimodal RoPE positions (M-RoPE; Wang et al., "Qwen2-VL", 2024; Bai et al., "Qwen2.5-VL Technical Report",
2025): three positions per token (temporal, height, width), as HF transformers' Qwen2_5_VLModel.get_rope_index
computes them. Text tokens take three equal positions counting on from the previous token; an image of llm grid
(t, h, w) (its patch grid over spatial_merge_size) placed when the count is at p takes (p + frame, p + row, p + col)
for its tokens in row-major order, and the text after it counts on from p + max(t, h, w) (one past its largest
position). So a prompt's positions run behind its token indices, by `delta` = max position + 1 - prompt length after
the last image, and a generated token at index i has position i + delta in all three.

A request's prompt positions are computed once (`prompt_positions`, when the request is built from the processor's
image grids) and kept on the request with its delta (engine.core.request.Request.mrope_positions / mrope_delta);
`step_rope_rows` gives a step's [3, T] rope rows from them. Pure numpy, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from engine.multimodal.inputs import MultiModalItem


class MRopeRequest(Protocol):
    """What step_rope_rows reads of a request (engine.core.request.Request; not imported: the core imports this
    package)."""

    mrope_positions: np.ndarray | None
    mrope_delta: int


def prompt_positions(num_tokens: int, items: Sequence[MultiModalItem], merge: int) -> np.ndarray:
    """M-RoPE positions int64 [3, num_tokens] of a prompt whose images are `items` (ordered by offset, each with its
    patch grid_thw) and spatial merge size `merge`. Raises ValueError for an item without a grid, or whose
    placeholders are not its grid's t * h * w / merge^2 tokens."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    at, nxt = 0, 0  # next token index, next position
    for item in items:
        if item.grid_thw is None:
            raise ValueError("an M-RoPE model's image needs its grid_thw (the processor's image_grid_thw)")
        t, h, w = item.grid_thw[0], item.grid_thw[1] // merge, item.grid_thw[2] // merge
        if t * h * w != item.length or item.offset < at:
            raise ValueError(f"image grid {item.grid_thw} (merge {merge}) does not fit its {item.length} placeholder "
                             f"tokens at offset {item.offset}")
        out[:, at:item.offset] = nxt + np.arange(item.offset - at)
        nxt += item.offset - at
        frame, row, col = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, item.offset:item.end] = nxt + np.stack([frame.ravel(), row.ravel(), col.ravel()])
        nxt += max(t, h, w)
        at = item.end
    out[:, at:] = nxt + np.arange(num_tokens - at)
    return out


def step_rope_rows(order: Sequence[tuple[MRopeRequest, int]], positions: np.ndarray) -> np.ndarray | None:
    """The rope rows int64 [3, T] of a step whose requests run in `order` (each feeding its tokens one after the
    other) at token `positions` int64 [T] (their indices in their sequences): a prompt token's M-RoPE positions, a
    generated token's index + its request's delta, a request without images (mrope_positions None) its indices in
    all three. None when no request of the step has images: its rope rows are `positions` (plain RoPE)."""
    if all(req.mrope_positions is None for req, _ in order):
        return None
    rows = np.broadcast_to(positions, (3, positions.shape[0])).copy()
    at = 0
    for req, n in order:
        table = req.mrope_positions
        if table is not None:
            idx = positions[at:at + n]
            prompt = table.shape[1]
            rows[:, at:at + n] = np.where(idx < prompt, table[:, np.minimum(idx, prompt - 1)], idx + req.mrope_delta)
        at += n
    return rows
