"""Incremental detokenization and stop strings: each step decodes a few tokens and searches a few characters.

Decoding the whole output again at every step (to look for stop strings) costs O(n) per step, O(n^2) per request.
Here a request keeps two offsets into its output tokens, as HF text-generation-inference's `decode_token` and
vLLM's `detokenize_incrementally` do: `prefix_offset..read_offset` are tokens whose text is already out (decoded
again only as context, so that a tokenizer that strips a word's leading space or merges bytes across tokens gives
the same text as a full decode), and `read_offset..` are the tokens not yet turned into text. New text is released
once it does not end in U+FFFD, the mark of a multi-byte UTF-8 character cut between tokens.

The final text (`finish`) is the full decode of the output tokens, cut at the stop string if one was found: what HF
transformers' `tokenizer.decode(output_ids, skip_special_tokens=True)` gives, and vLLM's final detokenization. So a
completion that max_tokens (or an end-of-sequence token) cuts inside a multi-byte character ends with U+FFFD, one per
incomplete character (schemas/arrow.py, `completion`); only the text released while generating holds it back.

Byte-level BPE tokenizers (GPT-2's ByteLevel decoder: Llama 3, Qwen, SmolLM2, ...) decode by concatenating each
token's bytes and decoding them as UTF-8 with U+FFFD for invalid bytes. For them each token's bytes are looked up
in a table built once per tokenizer and fed to Python's incremental UTF-8 decoder, which keeps a character cut
between tokens until its last byte arrives: one table lookup per new token instead of two decodes per step.
"""

from __future__ import annotations

import codecs
import functools
import re
import threading
from collections.abc import Sequence
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map of the 256 byte values to printable characters (Radford et al., 2019, `bytes_to_unicode`),
    inverted: character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_TABLE_LOCK = threading.Lock()


def byte_level_table(tokenizer: Any) -> tuple[bytes, ...] | None:
    """For a tokenizer whose Hugging Face backend decodes with the ByteLevel decoder alone: the bytes each token id
    contributes to a decode with special tokens skipped (b"" for special tokens), as the `tokenizers` ByteLevel
    decoder maps them (a character of the byte alphabet is its byte, any other character its UTF-8 bytes). None for
    other tokenizers (SentencePiece, WordPiece, ...) and for objects without a `hf_tokenizer.backend_tokenizer`.
    Built once per tokenizer (cached): the shards of a worker that start at once wait for the first build instead of
    each building it beside the engine's steps."""
    with _TABLE_LOCK:
        return _byte_level_table(tokenizer)


@functools.cache
def _byte_level_translation() -> tuple[dict[int, int], re.Pattern[str]]:
    """`str.translate`'s map of each byte-alphabet character to its byte (a code point below 256, so the translated
    token encodes to those bytes as Latin-1), and a pattern matching any character outside the alphabet."""
    alphabet = _byte_level_alphabet()
    return {ord(c): b for c, b in alphabet.items()}, re.compile(f"[^{re.escape(''.join(alphabet))}]")


@functools.lru_cache(maxsize=8)
def _byte_level_table(tokenizer: Any) -> tuple[bytes, ...] | None:
    import tokenizers

    backend = getattr(getattr(tokenizer, "hf_tokenizer", None), "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
        return None
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    alphabet = _byte_level_alphabet()
    to_bytes, outside = _byte_level_translation()
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        if token is None or i in special:
            table.append(b"")
        elif outside.search(token) is None:  # every character a byte of the alphabet: the common case, in C
            table.append(token.translate(to_bytes).encode("latin-1"))
        else:  # an added token's spaces, say: a character outside the alphabet is its UTF-8 bytes
            table.append(b"".join(bytes((alphabet[c],)) if c in alphabet else c.encode() for c in token))
    return tuple(table)


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (engine.text.tokenizer.Tokenizer has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """The text of one request's output tokens, built a few tokens at a time, cut at the first stop string.

    Args:
        tokenizer: decodes token ids to text (special tokens skipped, as the full decode of the output does).
        stop: strings that end the completion; the text is cut where the first one starts (the stop string itself
            is not part of it, as in OpenAI's API and vLLM).

    Attributes:
        prefix_offset, read_offset: token offsets (see the module docstring).
        stop_string: the stop string found, or None.

    NOTE: `update` searches only the new text plus the last len(longest stop) - 1 characters before it: a stop
    string ending earlier would have been found by an earlier update. Text held back behind a cut character is
    searched too (tentatively), so a stop string is found at the same token as a full decode would find it.
    """

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self.stop = tuple(stop)
        self._tail_len = max((len(s) for s in self.stop), default=1) - 1
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_string: str | None = None
        self._pieces: list[str] = []  # released text, in order
        self._tail = ""  # the last _tail_len released characters
        self._pending = ""  # complete characters decoded but held back behind a cut one
        self._held = ""  # the decode path's held-back text as decoded (with its trailing U+FFFD)
        self._final: str | None = None  # the text once finish() ran
        self._bytes = byte_level_table(tokenizer)
        self._cut = b""  # the bytes of a character cut between tokens, waiting for the rest (byte-level path)

    @property
    def text(self) -> str:
        """The text released so far (complete characters only; cut at the stop string once one is found)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, token_ids: Sequence[int], start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(list(token_ids[start:end]), skip_special_tokens=True)

    def update(self, token_ids: Sequence[int]) -> str | None:
        """Take in the output tokens past `read_offset` (token_ids: all output tokens so far, ids).

        Returns the stop string found (the text is then cut where it starts; call no more updates), or None.
        Cost: two decodes of the tokens from prefix_offset on (a few tokens per step) and a search of the new
        characters plus the tail.
        """
        if self.stop_string is not None or self._final is not None or len(token_ids) <= self.read_offset:
            return self.stop_string
        if self._bytes is not None:
            return self._update_bytes(token_ids)
        prefix_text = (self._decode(token_ids, self.prefix_offset, self.read_offset)
                       if self.read_offset > self.prefix_offset else "")
        new_text = self._decode(token_ids, self.prefix_offset)
        released = ""
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            released = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
            self._pending = self._held = ""
        else:
            self._held = new_text[len(prefix_text):]
            self._pending = self._held.rstrip(REPLACEMENT_CHAR)
        if self.stop:
            self._find_stop(released)
        if self.stop_string is None:
            self._release(released)
        return self.stop_string

    def _update_bytes(self, token_ids: Sequence[int]) -> str | None:
        """`update` for byte-level tokenizers: the new tokens' bytes through the incremental UTF-8 decoder. Text
        ending in U+FFFD (an invalid byte, which a full decode also shows as U+FFFD) is held back, as the decode
        path holds back a cut character, and released with the text that follows it."""
        table, size = self._bytes, len(self._bytes)
        n = len(token_ids)
        # NOTE: an id past the tokenizer's table (a model whose embedding is padded: Qwen2.5's 152,064 rows for
        # 151,665 tokens) has no text; the full decode skips it too.
        if n == self.read_offset + 1:  # the engine's case: one new token per step
            data = table[token_ids[-1]] if token_ids[-1] < size else b""
        else:
            data = b"".join([table[t] if t < size else b"" for t in token_ids[self.read_offset:]])
        self.read_offset = self.prefix_offset = n
        if self._cut:
            data = self._cut + data
        # What codecs' incremental UTF-8 decoder does, without its Python frame: decode the complete characters
        # (U+FFFD for invalid bytes), keep the bytes of a trailing cut one for the next token.
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._cut = data[used:]
        if self._pending:
            text = self._pending + text
        if text.endswith(REPLACEMENT_CHAR):
            keep = len(text.rstrip(REPLACEMENT_CHAR))
            released, self._pending = text[:keep], text[keep:]
        else:
            released, self._pending = text, ""
        if self.stop:
            window = self._tail + released + self._pending
            for s in self.stop:
                if s in window:
                    self._find_stop(released)
                    break
        if self.stop_string is None and released:  # _release, inline: this runs for every row every step
            self._pieces.append(released)
            if self._tail_len:
                self._tail = (self._tail + released)[-self._tail_len:]
        return self.stop_string

    def _release(self, text: str) -> None:
        if not text:
            return
        self._pieces.append(text)
        self._tail = (self._tail + text)[-self._tail_len:] if self._tail_len else ""

    def _find_stop(self, released: str) -> None:
        window = self._tail + released + self._pending
        for s in self.stop:
            if s in window:
                break
        else:  # the common case: no stop string in the window
            return
        hits = [(i, s) for s in self.stop if (i := window.find(s)) >= 0]
        start, self.stop_string = min(hits)
        cut = start - len(self._tail)  # where the stop string starts, from the end of the text released before
        if cut >= 0:
            self._release(window[len(self._tail):start])
        else:  # it began in released text: take that back
            self._pieces = [self.text[:cut]]
        self._pending = ""

    def finish(self, token_ids: Sequence[int]) -> str:
        """The final text: takes in any tokens not yet decoded (one decode for all of them: the path of a request
        without stop strings, which needs no per-step text) and releases the held-back text as the full decode
        ends: a multi-byte character cut by the end of generation is U+FFFD, as in HF transformers' decode of the
        same ids (the module docstring). token_ids: all output tokens (ids). Returns the text (str); later calls
        return it again.
        """
        if self._final is None:
            self.update(token_ids)
            if self.stop_string is None:
                if self._bytes is not None:  # the cut character's bytes, decoded as final: U+FFFD
                    held = self._pending + codecs.utf_8_decode(self._cut, "replace", True)[0]
                else:
                    held = self._held
                self._release(held)
            self._pending = self._held = ""
            self._cut = b""
            self._final = self.text
        return self._final
