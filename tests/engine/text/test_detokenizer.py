"""engine.text.detokenizer with the packaged model's tokenizer on real text (AlpacaEval answers with emoji, accents and
CJK; GSM8K answers): incremental text equals a full decode, stop strings across token boundaries, and the same
stops as the full decode at every step that it replaces."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer

MAX_TOKENS = 256  # per sequence: long enough for many windows, short enough for the O(n^2) reference


@pytest.fixture(scope="module")
def tokenizer(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def sequences(tokenizer: Tokenizer, data_dir: Path) -> list[list[int]]:
    """Token ids of real answers: every AlpacaEval reference answer and GSM8K answer with non-ASCII characters,
    and as many plain ones; EOS appended to some (special tokens are skipped in the text)."""
    alpaca = pq.read_table(data_dir / "alpaca_eval.parquet", columns=["reference_output"]).column(0).to_pylist()
    gsm8k = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["answer"]).column(0).to_pylist()
    texts = []
    for col in (alpaca, gsm8k):
        wide = [t for t in col if any(ord(c) > 127 for c in t)]
        texts += wide + [t for t in col if t.isascii()][:len(wide)]
    assert any(any(ord(c) > 0xFFFF for c in t) for t in texts), "no emoji in the data"
    seqs = [tokenizer.encode(t)[:MAX_TOKENS] for t in texts]
    return [s + [tokenizer.eos_token_id] if i % 5 == 0 else s for i, s in enumerate(seqs)]


@pytest.fixture(scope="module")
def prefixes(tokenizer: Tokenizer, sequences: list[list[int]]) -> list[list[str]]:
    """The reference decodes: `_prefix_texts` of each sequence (HF's decode of every prefix, O(n^2) decoding and most
    of this module's time), made once for the tests that compare against them."""
    return [_prefix_texts(tokenizer, ids) for ids in sequences]


def _incremental(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[int, str]:
    """As the engine runs it: one update per sampled token. Returns (tokens consumed, final text)."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    for n in range(1, len(ids) + 1):
        if detok.update(ids[:n]) is not None:
            return n, detok.finish(ids[:n])
        assert not detok.text.endswith(REPLACEMENT_CHAR)
    return len(ids), detok.finish(ids)


def _prefix_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The full decode of every prefix: [decode(ids[:n]) for n in 0..len(ids)] (O(n^2) decoding: computed once per
    sequence: the `prefixes` fixture, which the references of its stop strings and cut characters share)."""
    return [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]


def _full_decode_each_step(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...],
                           prefix_texts: list[str] | None = None) -> tuple[int, str]:
    """The approach it replaces: decode the whole output at every step and find the earliest stop string.
    prefix_texts: `_prefix_texts(tokenizer, ids)` when already computed (the same decodes)."""
    texts = _prefix_texts(tokenizer, ids) if prefix_texts is None else prefix_texts
    for n in range(1, len(ids) + 1):
        text = texts[n]
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            return n, text[:min(hits)]
    return len(ids), texts[len(ids)]


def test_incremental_text_equals_the_full_decode(tokenizer: Tokenizer, sequences: list[list[int]]) -> None:
    for ids in sequences:
        full = tokenizer.decode(ids)
        assert _incremental(tokenizer, ids) == (len(ids), full)
        # The path of a request without stop strings: no update per step, one decode at finish (and again the same).
        detok = IncrementalDetokenizer(tokenizer)
        assert detok.finish(ids) == full == detok.finish(ids)


def test_released_text_is_always_a_prefix_of_complete_characters(tokenizer: Tokenizer, sequences: list[list[int]],
                                                                  prefixes: list[list[str]]) -> None:
    wide = [(ids, texts) for ids, texts in zip(sequences, prefixes, strict=True)
            if any(ord(c) > 0x7FF for c in texts[-1])]
    assert len(wide) > 20
    for ids, texts in wide:
        detok = IncrementalDetokenizer(tokenizer)
        for n in range(1, len(ids) + 1):
            detok.update(ids[:n])
            assert texts[n].startswith(detok.text)
            assert not detok.text.endswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize("byte_level", [True, False])
def test_a_cut_multibyte_character_ends_the_final_text_as_the_full_decode(tokenizer: Tokenizer,
                                                                          sequences: list[list[int]],
                                                                          prefixes: list[list[str]],
                                                                          byte_level: bool) -> None:
    """Output cut inside a multi-byte character (max_tokens): the final text is HF's decode of the ids, ending in
    U+FFFD, after per-step updates and from one finish alike; through the byte table and the decode path (the
    path of SentencePiece and other tokenizers). Text released while generating never ends in one."""
    cuts = 0

    def detokenizer() -> IncrementalDetokenizer:
        detok = IncrementalDetokenizer(tokenizer)
        if not byte_level:
            detok._bytes = None
        return detok

    step = 2 if byte_level else 6
    for ids, texts in zip(sequences[::step], prefixes[::step], strict=True):
        for n in range(1, len(ids) + 1):
            full = texts[n]
            if not full.endswith(REPLACEMENT_CHAR):
                continue
            cuts += 1  # a generation stopped here (max_tokens) ends inside a character
            detok = detokenizer()
            for k in range(1, n + 1):
                detok.update(ids[:k])
                assert not detok.text.endswith(REPLACEMENT_CHAR)
            assert detok.finish(ids[:n]) == full
            assert detokenizer().finish(ids[:n]) == full
    assert cuts > 10, "the data should cut many multi-byte characters between tokens"


def _boundary_spanning_stops(tokenizer: Tokenizer, ids: list[int], prefix_texts: list[str]) -> list[str]:
    """Substrings of the text that start inside one token's text and end inside a later token's, some of them
    with non-ASCII characters. prefix_texts: `_prefix_texts(tokenizer, ids)`."""
    text = prefix_texts[len(ids)]
    ends = [len(t) for t in prefix_texts[1:]]
    stops = []
    for a, b in ((len(ids) // 3, len(ids) // 3 + 2), (len(ids) // 2, len(ids) // 2 + 1), (len(ids) - 4, len(ids) - 2)):
        if 0 < a < b < len(ids) and ends[b] - ends[a - 1] > 3:
            s = text[ends[a - 1] + 1:ends[b] - 1]  # a character into token a to a character before token b's end
            if s.strip() and REPLACEMENT_CHAR not in s:
                stops.append(s)
    wide = [c for c in text if ord(c) > 127 and c != REPLACEMENT_CHAR]
    if wide:
        i = text.index(wide[len(wide) // 2])
        stops.append(text[max(0, i - 2):i + 2])
    return stops


def test_stop_strings_across_token_boundaries_stop_where_the_full_decode_did(tokenizer: Tokenizer,
                                                                               sequences: list[list[int]],
                                                                               prefixes: list[list[str]]) -> None:
    checked = 0
    for ids, texts in zip(sequences, prefixes, strict=True):
        text = texts[-1]
        assert text == tokenizer.decode(ids)
        for stop in _boundary_spanning_stops(tokenizer, ids, texts):
            got = _incremental(tokenizer, ids, (stop,))
            assert got == _full_decode_each_step(tokenizer, ids, (stop,), texts)
            assert got[1] == text[:text.index(stop)] and got[0] < len(ids) + 1
            checked += 1
        # Several stop strings at once: the earliest match wins, whatever their order.
        stops = tuple(_boundary_spanning_stops(tokenizer, ids, texts))[::-1] + ("\n\n", "zzzz never there")
        assert _incremental(tokenizer, ids, stops) == _full_decode_each_step(tokenizer, ids, stops, texts)
    assert checked > 100


def test_a_stop_string_that_started_in_earlier_text_cuts_it_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The café served crème brûlée 🍮 and coffee ☕ until midnight.")
    detok = IncrementalDetokenizer(tokenizer, ("brûlée 🍮 and", "midnight"))
    n, released_before_stop = 0, ""
    while detok.update(ids[:n + 1]) is None:
        n += 1
        released_before_stop = detok.text
    assert "brûlée 🍮" in released_before_stop  # released: it could still have been plain text
    assert detok.stop_string == "brûlée 🍮 and"
    assert detok.finish(ids[:n + 1]) == "The café served crème "
    # The stop token: the one whose text completes the match.
    assert "brûlée 🍮 and" in tokenizer.decode(ids[:n + 1]) and "brûlée 🍮 and" not in tokenizer.decode(ids[:n])


def test_text_without_any_stop_match_is_the_whole_output(tokenizer: Tokenizer, sequences: list[list[int]]) -> None:
    for ids in sequences[:40]:
        assert _incremental(tokenizer, ids, ("\x00never",)) == (len(ids), tokenizer.decode(ids))


def test_byte_level_path_equals_the_full_decode_on_random_token_ids(tokenizer: Tokenizer) -> None:
    """Random ids make invalid UTF-8 (stray continuation bytes, cut characters) and special tokens mid-text: the
    byte table path (one lookup per token) gives the full decode's text at every step, and its stops."""
    import random

    from engine.text.detokenizer import byte_level_table

    assert byte_level_table(tokenizer) is not None  # SmolLM2's tokenizer is byte-level BPE: the fast path runs
    rng = random.Random(0)
    invalid = 0
    for _ in range(40):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(60)]
        ids[rng.randrange(60)] = tokenizer.eos_token_id  # a special token inside the output, skipped in the text
        detok = IncrementalDetokenizer(tokenizer)
        for n in range(1, len(ids) + 1):
            detok.update(ids[:n])
            full = tokenizer.decode(ids[:n])
            invalid += REPLACEMENT_CHAR in full
            assert full.startswith(detok.text) and not detok.text.endswith(REPLACEMENT_CHAR)
        assert detok.finish(ids) == tokenizer.decode(ids)
        text = tokenizer.decode(ids)
        stop = text[len(text) // 2:len(text) // 2 + 3]
        if stop and REPLACEMENT_CHAR not in stop:
            assert _incremental(tokenizer, ids, (stop,)) == _full_decode_each_step(tokenizer, ids, (stop,))
    assert invalid > 100, "random ids should make many invalid byte sequences"


def test_the_byte_table_holds_each_tokens_bytes(tokenizer: Tokenizer) -> None:
    """Each id's bytes in the byte-level table are the text of that token alone (special tokens none), also for
    added tokens holding characters outside the byte alphabet (a space, CJK: their UTF-8 bytes)."""
    import copy

    from engine.text.detokenizer import byte_level_table

    hf = copy.deepcopy(tokenizer.hf_tokenizer)
    hf.add_tokens(["new token", "日本 x"])
    table = byte_level_table(Tokenizer(hf))
    assert len(table) == tokenizer.vocab_size + 2 and table[-2:] == (b"new token", "日本 x".encode())
    texts = hf.batch_decode([[i] for i in range(len(table))], skip_special_tokens=True)
    assert table[tokenizer.eos_token_id] == b"" and texts[tokenizer.eos_token_id] == ""
    whole = [i for i, b in enumerate(table) if REPLACEMENT_CHAR not in b.decode("utf-8", "replace")]
    assert len(whole) > 40_000  # most tokens are whole characters; the rest are bytes of a cut one
    assert all(table[i].decode() == texts[i] for i in whole)
    assert all(REPLACEMENT_CHAR in texts[i] for i in set(range(len(table))) - set(whole))


def test_ids_past_the_tokenizer_have_no_text_as_in_the_full_decode(tokenizer: Tokenizer, data_dir: Path) -> None:
    """A model whose embedding has more rows than its tokenizer has tokens (Qwen2.5: 152,064 for 151,665) can
    sample an id past the tokenizer's table: it adds no text, as the full decode skips it, and nothing raises."""
    from engine.text.detokenizer import byte_level_table

    size = len(byte_level_table(tokenizer))
    text = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question"]).column(0)[0].as_py()
    ids = tokenizer.encode(text)[:12]
    ids = ids[:6] + [size, size + 3] + ids[6:] + [size + 1]
    detok = IncrementalDetokenizer(tokenizer)
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n])
    assert detok.finish(ids) == tokenizer.decode(ids) == tokenizer.decode([t for t in ids if t < size])
