"""Bidirectional image attention on the host (a model whose image placeholders attend to each other in prefill:
ModelBase.bidirectional_images, Gemma 3): the rule that a prefill chunk never ends inside an image's placeholders
(`whole_image_chunk`, which the scheduler applies: a placeholder must see the later ones of its image, so they are
computed in the same chunk), and the spans a step passes to the attention (`image_spans`, the model runner's:
engine.layers.attention.AttentionMetadata.image_spans, masked by engine.layers.batch_plan). A chunk may start inside
an image (after a prefix-cache hit): the image's earlier placeholders are in the cache, computed whole by the row that
cached them. As vLLM's scheduler keeps a multimodal item in one chunk where the model needs it (its
disable_chunked_mm_input; no code of it). Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.multimodal.inputs import MultiModalItem


class _Fed(Protocol):
    """What image_spans reads of a request: its images and the tokens already in the KV cache."""

    mm_items: tuple[MultiModalItem, ...]
    num_computed_tokens: int


def whole_image_chunk(items: Sequence[MultiModalItem], start: int, n: int) -> int:
    """The tokens a prefill chunk from token `start` may feed of the `n` it could (n >= 1), for a request whose
    images are `items` (by offset): n, or fewer so that the chunk ends right before the image it would end inside;
    0 when the chunk starts at or inside that image (the request waits for a step with budget for the image's
    rest)."""
    end = start + n
    for item in items:
        if item.offset >= end:
            break
        if end < item.end:
            return max(item.offset - start, 0)
    return n


def image_spans(order: Sequence[tuple[_Fed, int]]) -> tuple[tuple[int, int, int], ...]:
    """(index in `order`, first placeholder position, one past the last) of each image a step's chunk feeds a
    placeholder of other than its last (a query that sees later keys); `order`: (request, tokens fed from its
    num_computed_tokens) in the order the step runs them. Raises RuntimeError when a chunk ends inside an image
    (its later placeholders not computed: whole_image_chunk was not applied)."""
    spans = []
    for b, (req, n) in enumerate(order):
        items, start = req.mm_items, req.num_computed_tokens
        if not items or start >= items[-1].end - 1:
            continue
        end = start + n
        for item in items:
            if item.offset >= end:
                break
            if max(start, item.offset) < item.end - 1:
                if end < item.end:
                    raise RuntimeError(f"a prefill chunk of tokens [{start}, {end}) ends inside the image at "
                                       f"[{item.offset}, {item.end}); a model with bidirectional image attention "
                                       "needs the scheduler's whole_image_chunk")
                spans.append((b, item.offset, item.end))
    return tuple(spans)
