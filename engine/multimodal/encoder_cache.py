"""The encoder cache: image features (the vision encoder's output, one row per placeholder token) kept by mm hash
while the prompts that hold the image are prefilled, so that a prefill chunked across steps, or several rows with
the same image, run the encoder once per image. Inspired by vLLM v1's EncoderCacheManager (a budget in tokens,
entries referenced by the requests that still need them, freed ones kept for reuse until their room is needed);
no code of it.

An entry is *in use* while some request's prefill has not passed the image's placeholders; once none does it is
*freed* but kept, reusable by a later request with the same image, until the budget needs its room (least recently
used first). The budget bounds what is kept across steps: when a step's own images need more, entries in use by
other requests are dropped too (their images are encoded again when those requests reach them: slower, never
wrong), and a step's images are always kept for that step even beyond the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class EncoderCache:
    """Image features by mm hash, with a budget in tokens (feature rows).

    Args:
        budget_tokens: feature rows to keep across steps (>= 1).
    Attributes:
        num_encoded: images put in the cache (encoder runs, per image) over its life; num_hits: lookups found.
    Raises ValueError for a budget below 1.
    """

    def __init__(self, budget_tokens: int) -> None:
        if budget_tokens < 1:
            raise ValueError(f"the encoder cache budget must be >= 1 token, got {budget_tokens}")
        self.budget_tokens = budget_tokens
        self._features: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recently used first
        self._users: dict[str, set[str]] = {}  # mm hash -> ids of the requests whose prefill has not passed it
        self.num_tokens = 0
        self.num_encoded = 0
        self.num_hits = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._features

    def __len__(self) -> int:
        return len(self._features)

    def get(self, mm_hash: str) -> torch.Tensor | None:
        """The features [tokens, hidden] of `mm_hash` (marked recently used), or None."""
        feats = self._features.get(mm_hash)
        if feats is not None:
            self._features.move_to_end(mm_hash)
            self.num_hits += 1
        return feats

    def put(self, mm_hash: str, features: torch.Tensor, keep: Collection[str] = ()) -> None:
        """Keep `features` [tokens, hidden] under `mm_hash`, first evicting what the budget needs: freed entries,
        then entries in use, least recently used first, never one in `keep` (the hashes the current step reads)."""
        if mm_hash in self._features:
            return
        need = self.num_tokens + int(features.shape[0]) - self.budget_tokens
        if need > 0:
            for in_use in (False, True):
                for h in [h for h in self._features if bool(self._users.get(h)) == in_use and h not in keep]:
                    if need <= 0:
                        break
                    need -= self._drop(h)
        self._features[mm_hash] = features
        self.num_tokens += int(features.shape[0])
        self.num_encoded += 1

    def use(self, mm_hash: str, request_id: str) -> None:
        """`request_id` still needs `mm_hash` (its prefill has not passed the image)."""
        self._users.setdefault(mm_hash, set()).add(request_id)

    def release(self, mm_hash: str, request_id: str) -> None:
        """`request_id`'s prefill is past the image: the entry is freed when no other request needs it."""
        users = self._users.get(mm_hash)
        if users is not None:
            users.discard(request_id)
            if not users:
                del self._users[mm_hash]

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Requests that left (finished, aborted) need no image any more."""
        ids = set(request_ids)
        for h in [h for h, users in self._users.items() if users & ids]:
            users = self._users[h]
            users -= ids
            if not users:
                del self._users[h]

    def in_use(self, mm_hash: str) -> bool:
        """Whether some request still needs `mm_hash`."""
        return bool(self._users.get(mm_hash))

    def _drop(self, mm_hash: str) -> int:
        feats = self._features.pop(mm_hash)
        self.num_tokens -= int(feats.shape[0])
        return int(feats.shape[0])
