"""A step's input embeddings for a vision-language model: the token embeddings with the rows of image placeholder
tokens replaced by the image's encoder features. The images whose placeholders a step's prefill chunks cover are
encoded in one batched call (those not in the encoder cache: engine.multimodal.encoder_cache), and each chunk takes
the feature rows of the placeholders it covers, so a chunk boundary inside an image's placeholders splits its rows
across steps and the image is encoded once. Steps that cover no placeholder (decodes, text) feed token ids as
before. A DeepStack model's features (Qwen3-VL: [tokens, 1 + K, hidden]) are cached and sliced whole: level 0 is
merged into the input embeddings and levels 1..K go to the model's forward with the same rows
(engine.model.base.DeepStackFeatures). Source: the merge of HF LlavaModel.forward (masked_scatter of image features
at the image token) and HF's Qwen3-VL forward (visual_pos_masks, deepstack_visual_embeds); vLLM v1's encoder cache
and scheduled encoder inputs as the design model (no code of it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from engine.core.scheduler import ScheduledRequest
from engine.model.base import DeepStackFeatures, ModelBase
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import MultiModalItem


class _Span(NamedTuple):
    """Placeholder rows of one image that a step feeds: step rows [row, row + count) take feature rows
    [first, first + count); `done` when the chunk reaches the image's last placeholder."""

    item: MultiModalItem
    request_id: str
    row: int
    first: int
    count: int
    done: bool


class ImageInputs(NamedTuple):
    """A step's model inputs with its image features merged: inputs_embeds [T, hidden] (model dtype), and for a
    DeepStack model the features its decoder layers add at the placeholder rows (else None)."""

    inputs_embeds: torch.Tensor
    deepstack: DeepStackFeatures | None

    def model_kwargs(self) -> dict[str, Any]:
        """The keywords of the model's forward: inputs_embeds, and deepstack only where there is some (the models
        without DeepStack take no such keyword)."""
        if self.deepstack is None:
            return {"inputs_embeds": self.inputs_embeds}
        return {"inputs_embeds": self.inputs_embeds, "deepstack": self.deepstack}


def default_budget(tokens_per_image: int, max_num_batched_tokens: int) -> int:
    """The encoder cache's default budget in feature rows: a step's worth of tokens, and never fewer than two
    images (one being prefilled across a chunk boundary, one more to reuse)."""
    return max(max_num_batched_tokens, 2 * tokens_per_image)


class ImageEmbedder:
    """Builds the inputs_embeds of the steps that feed image placeholders, with an encoder cache.

    Args:
        model: a model with config.vision (its `encode_images` and `embed`).
        device: the model's device.
        budget_tokens: the encoder cache's budget in feature rows (default_budget).
    """

    def __init__(self, model: ModelBase, device: torch.device, budget_tokens: int) -> None:
        self.model = model
        self.device = device
        self.cache = EncoderCache(budget_tokens)

    def spans(self, order: Sequence[ScheduledRequest]) -> list[_Span]:
        """The image placeholder rows fed by a step whose requests run in `order` (each feeding tokens
        [num_computed_tokens, + num_new_tokens), its rows one after the other)."""
        out: list[_Span] = []
        row = 0
        for req, n in order:
            items = req.mm_items
            start = req.num_computed_tokens
            if items and start < items[-1].end:
                end = start + n
                for item in items:
                    a, b = max(start, item.offset), min(end, item.end)
                    if a < b:
                        out.append(_Span(item, req.request_id, row + a - start, a - item.offset, b - a,
                                         b == item.end))
            row += n
        return out

    def inputs(self, order: Sequence[ScheduledRequest], input_ids: torch.Tensor) -> ImageInputs | None:
        """The ImageInputs (inputs_embeds [T, hidden] in the model's dtype, DeepStack features or None) of a step
        whose requests run in `order` with input_ids int64 [T] on the device, or None when the step feeds no image
        placeholder (run it on input_ids)."""
        spans = self.spans(order)
        if not spans:
            return None
        cache = self.cache
        step_hashes = {s.item.mm_hash for s in spans}
        missing: dict[str, MultiModalItem] = {}
        for s in spans:
            if s.item.mm_hash not in cache and s.item.mm_hash not in missing:
                missing[s.item.mm_hash] = s.item
        for items in _by_shape(missing.values()):
            for it, f in zip(items, self._encode(items), strict=True):
                cache.put(it.mm_hash, f, keep=step_hashes)
        embeds = self.model.embed(input_ids)
        rows, feats = [], []
        for s in spans:
            f = cache.get(s.item.mm_hash)
            if f is None or f.shape[0] != s.item.length:
                raise RuntimeError(f"image {s.item.mm_hash} of request {s.request_id!r}: no features of "
                                   f"{s.item.length} rows in the encoder cache")
            rows.append(torch.arange(s.row, s.row + s.count))
            feats.append(f[s.first:s.first + s.count])
            if s.done:
                cache.release(s.item.mm_hash, s.request_id)
            else:
                cache.use(s.item.mm_hash, s.request_id)
        at, merged = torch.cat(rows).to(embeds.device), torch.cat(feats).to(embeds.dtype)
        if merged.dim() == 2:
            embeds.index_copy_(0, at, merged)
            return ImageInputs(embeds, None)
        embeds.index_copy_(0, at, merged[:, 0])  # level 0: the input embeddings; 1..K: DeepStack's
        return ImageInputs(embeds, DeepStackFeatures(at, merged[:, 1:]))

    def _encode(self, items: list[MultiModalItem]) -> Sequence[torch.Tensor]:
        """Each item's features [length, hidden] from one encoder call: fixed-size images stacked
        (encode_images(pixel_values [N, C, H, W]) -> [N, length, hidden]; LLaVA-NeXT's anyres items [N, tiles, C, H,
        W] with their image_sizes -> N tensors [length, hidden]); dynamic-resolution ones (grid_thw set)
        concatenated with their grids (encode_images(patches, grid_thw int64 [N, 3]) -> [sum of lengths, hidden], or
        [sum of lengths, 1 + K, hidden] for a DeepStack model)."""
        if items[0].grid_thw is None:
            pixels = torch.stack([it.pixel_values for it in items]).to(self.device)
            if items[0].image_size is None:
                return self.model.encode_images(pixels)
            return self.model.encode_images(pixels, image_sizes=[it.image_size for it in items])  # LLaVA-NeXT
        grids = torch.tensor([it.grid_thw for it in items], dtype=torch.int64)
        patches = torch.cat([it.pixel_values for it in items]).to(self.device)
        return self.model.encode_images(patches, grids).split([it.length for it in items])

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Requests that left the batch need no image any more (EncoderCache.forget_requests)."""
        self.cache.forget_requests(request_ids)


def _by_shape(items: Iterable[MultiModalItem]) -> list[list[MultiModalItem]]:
    """Items grouped by pixel_values shape (one encoder call per group; dynamic-resolution items, grid_thw set,
    all in one), order kept within a group."""
    groups: dict[tuple[int, ...], list[MultiModalItem]] = {}
    for it in items:
        groups.setdefault(() if it.grid_thw is not None else tuple(it.pixel_values.shape), []).append(it)
    return list(groups.values())
