"""Token ids of a prompt whose image placeholders were replaced by the processor's text, made equal to what the HF
processor's own tokenization of the whole expanded text gives.

engine.multimodal.processor splices each replacement's token ids into the prompt's ids. That equals tokenizing the
expanded text whole when a replacement starts and ends with added tokens (LLaVA's image tokens, Idefics3's
<fake_token_around_image>, Qwen2-VL's <|vision_start|>...<|vision_end|>): a tokenizer splits text at its added
tokens and encodes each piece between them alone. Gemma 3's replacement,
"\\n\\n<start_of_image>...<end_of_image>\\n\\n", begins and ends with plain text, which joins the prompt's text
around the placeholder into one piece: the whole text encodes "user\\n" + "\\n\\n" as one run of newlines, not two
(vLLM's Gemma 3 processor merges these newline tokens for the same reason; no code of it). `rejoin` re-encodes each
piece that a splice cut, from its decoded text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _encode(hf_tokenizer: Any, text: str) -> list[int]:
    """Token ids of plain `text`: no special tokens added, none parsed from the text."""
    return list(hf_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _decode(hf_tokenizer: Any, ids: Sequence[int]) -> str:
    return hf_tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _piece(ids: Sequence[int], cut: int, added: frozenset[int]) -> tuple[int, int]:
    """[start, end) of the run of non-added tokens of `ids` around index `cut` (between ids[cut - 1] and ids[cut])."""
    start, end = cut, cut
    while start > 0 and ids[start - 1] not in added:
        start -= 1
    while end < len(ids) and ids[end] not in added:
        end += 1
    return start, end


def rejoin(ids: list[int], cuts: Sequence[int], hf_tokenizer: Any, added: frozenset[int]
           ) -> tuple[list[int], list[int]]:
    """(ids with each text piece that a splice cut re-encoded whole, shift) where shift[i] is how far the token at
    old index i moved (valid for the indices of added tokens, which no re-encoding touches: the images'
    placeholders). `cuts`: the indices in `ids` where a spliced replacement starts or ends; `added`: the ids of
    the tokenizer's added tokens (get_added_vocab's), where its tokenization splits text. A piece is re-encoded
    only where each of its spliced parts encodes back to itself from its decoded text (byte-level BPE and Gemma's
    tokenizer do; a tokenizer that adds a prefix space to every encoded text does not, and its splice is kept)."""
    pieces: dict[tuple[int, int], set[int]] = {}
    for cut in cuts:
        if 0 < cut < len(ids) and ids[cut - 1] not in added and ids[cut] not in added:
            pieces.setdefault(_piece(ids, cut, added), set()).add(cut)
    out: list[int] = []
    shift = [0] * (len(ids) + 1)
    prev = moved = 0
    for (start, end), inner in sorted(pieces.items()):
        bounds = [start, *sorted(inner), end]
        parts = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        whole = ids[start:end]
        if all(_encode(hf_tokenizer, _decode(hf_tokenizer, p)) == p for p in parts):
            whole = _encode(hf_tokenizer, _decode(hf_tokenizer, whole))
        out += ids[prev:start] + whole
        shift[prev:start] = [moved] * (start - prev)
        moved += len(whole) - (end - start)
        prev = end
    out += ids[prev:]
    shift[prev:] = [moved] * (len(shift) - prev)
    return out, shift[:len(ids)]
