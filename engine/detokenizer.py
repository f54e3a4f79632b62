"""Incremental detokenization and stop strings: each step decodes a few tokens and searches a few characters.

Decoding the whole output again at every step (to look for stop strings) costs O(n) per step, O(n^2) per request.
Here a request keeps two offsets into its output tokens, as HF text-generation-inference's `decode_token` and
vLLM's `detokenize_incrementally` do: `prefix_offset..read_offset` are tokens whose text is already out (decoded
again only as context, so that a tokenizer that strips a word's leading space or merges bytes across tokens gives
the same text as a full decode), and `read_offset..` are the tokens not yet turned into text. New text is released
once it does not end in U+FFFD, the mark of a multi-byte UTF-8 character cut between tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs of a tokenizer (engine.tokenizer.Tokenizer has it)."""

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
        self._final: str | None = None  # the text once finish() ran

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
        prefix_text = (self._decode(token_ids, self.prefix_offset, self.read_offset)
                       if self.read_offset > self.prefix_offset else "")
        new_text = self._decode(token_ids, self.prefix_offset)
        released = ""
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            released = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
            self._pending = ""
        else:
            self._pending = new_text[len(prefix_text):].rstrip(REPLACEMENT_CHAR)
        if self.stop:
            self._find_stop(released)
        if self.stop_string is None:
            self._release(released)
        return self.stop_string

    def _release(self, text: str) -> None:
        if not text:
            return
        self._pieces.append(text)
        self._tail = (self._tail + text)[-self._tail_len:] if self._tail_len else ""

    def _find_stop(self, released: str) -> None:
        window = self._tail + released + self._pending
        hits = [(i, s) for s in self.stop if (i := window.find(s)) >= 0]
        if not hits:
            return
        start, self.stop_string = min(hits)
        cut = start - len(self._tail)  # where the stop string starts, from the end of the text released before
        if cut >= 0:
            self._release(window[len(self._tail):start])
        else:  # it began in released text: take that back
            self._pieces = [self.text[:cut]]
        self._pending = ""

    def finish(self, token_ids: Sequence[int]) -> str:
        """The final text: takes in any tokens not yet decoded (one decode for all of them: the path of a request
        without stop strings, which needs no per-step text) and releases held-back complete characters.

        A trailing U+FFFD, from a multi-byte character cut by the end of generation, is dropped: the text never
        ends with one. token_ids: all output tokens (ids). Returns the text (str); later calls return it again.
        """
        if self._final is None:
            self.update(token_ids)
            if self.stop_string is None:
                self._release(self._pending)
            self._pending = ""
            self._final = self.text
        return self._final
