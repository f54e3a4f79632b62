"""Bidirectional image attention (Gemma 3): a step's image spans (AttentionMetadata.image_spans) against a dense
oracle masked by HF transformers' own Gemma 3 mask functions (get_block_sequence_ids_for_mask, blockwise_overlay,
sliding_window_overlay: OR(causal, same image), AND the window on sliding layers), on the torch and the CPU
backends, windowed and not, with an image that started before the chunk (a prefix-cache hit inside it) and a decode
beside the chunks; and the host rules: the spans of a step, and the chunk cut that keeps an image whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attention_steps import dense_attention, make_step

from engine.layers.attention import paged_attention_cpu, paged_attention_ref
from engine.multimodal.image_attention import image_spans, whole_image_chunk

# (query_lens, seq_lens): a decode, a whole prefill of 12 with an image at [3, 9), a 20-token chunk [20, 40)
# holding the end of an image at [15, 25) and a whole one at [30, 38).
QUERY_LENS, SEQ_LENS = [1, 12, 20], [30, 12, 40]
SPANS = ((1, 3, 9), (2, 15, 25), (2, 30, 38))


def _hf_mask(window: int | None):
    """mask(request, query positions, key positions) of HF's Gemma 3 masks over each request's image tokens."""
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        or_masks,
        sliding_window_overlay,
    )
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    def mask(b: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        token_type_ids = torch.zeros(1, SEQ_LENS[b], dtype=torch.int64)
        for r, start, end in SPANS:
            if r == b:
                token_type_ids[0, start:end] = 1
        fn = or_masks(causal_mask_function, blockwise_overlay(get_block_sequence_ids_for_mask(token_type_ids)))
        if window is not None:
            fn = and_masks(sliding_window_overlay(window), fn)
        return fn(0, 0, q, k)

    return mask


@pytest.mark.parametrize("window", [None, 4, 7])
@pytest.mark.parametrize("fn", [paged_attention_ref, paged_attention_cpu])
def test_image_spans_attend_as_hf_gemma3_mask(fn, window: int | None) -> None:
    q, kc, vc, meta = make_step(QUERY_LENS, SEQ_LENS, 4, 2, 8, torch.float32)
    meta.image_spans = SPANS
    want = dense_attention(q, kc, vc, meta, 0.125, mask=_hf_mask(window))
    got = fn(q, kc, vc, meta, 0.125, sliding_window=window)
    assert torch.allclose(got, want, atol=1e-5)
    # the spans change the image rows (so the check can fail), and nothing else
    causal = dense_attention(q, kc, vc, meta, 0.125, sliding_window=window)
    changed = (causal - want).abs().amax((1, 2)) > 1e-4
    rows = [1 + p for p in range(3, 8)] + [13 + p - 20 for p in range(20, 24)] + [13 + p - 20 for p in range(30, 37)]
    assert changed.nonzero().flatten().tolist() == rows


def _request(offsets: list[tuple[int, int]], done: int) -> SimpleNamespace:
    items = tuple(SimpleNamespace(offset=a, length=b - a, end=b) for a, b in offsets)
    return SimpleNamespace(mm_items=items, num_computed_tokens=done)


def test_image_spans_of_a_step() -> None:
    order = [(_request([(3, 9)], 30), 1),  # decoding after its image
             (_request([(3, 9), (12, 20)], 0), 12),  # the first image whole, the chunk ends before the second
             (_request([(15, 25), (30, 38)], 20), 20),  # starts inside an image
             (_request([(4, 8)], 7), 1)]  # a one-token chunk of an image's last placeholder: causal anyway
    assert image_spans(order) == ((1, 3, 9), (2, 15, 25), (2, 30, 38))
    with pytest.raises(RuntimeError, match="ends inside the image at"):
        image_spans([(_request([(3, 9)], 0), 5)])


def test_whole_image_chunk_ends_before_an_image_it_would_split() -> None:
    items = _request([(4, 20), (23, 39)], 0).mm_items
    assert whole_image_chunk(items, 0, 18) == 4  # ends before the first image
    assert whole_image_chunk(items, 0, 20) == 20  # ends at its end
    assert whole_image_chunk(items, 4, 18) == 18  # the image and two tokens after it
    assert whole_image_chunk(items, 20, 10) == 3  # cut before the second image
    assert whole_image_chunk(items, 4, 10) == 0  # starts at the image: waits for a step with room for it
    assert whole_image_chunk(items, 10, 5) == 0  # starts inside it (a prefix-cache hit)
    assert whole_image_chunk(items, 39, 5) == 5  # past every image
