"""The tokenizer cache (engine/text/tokenizer.py): a GGUF's tokenizer is built once, then read from its cached folder,
and
the cached tokenizer is the same tokenizer on real prompts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from engine.text.tokenizer import Tokenizer, _gguf_tokenizer_cache


def test_cached_tokenizer_equals_the_gguf_build(gguf_path: str, gsm8k_questions: list[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    folder = _gguf_tokenizer_cache(gguf_path)
    assert not folder.exists()
    built = Tokenizer.from_gguf(gguf_path)
    assert (folder / "tokenizer.json").is_file()
    cached = Tokenizer.from_gguf(gguf_path)  # read from the folder this time
    assert type(cached._tok) is type(built._tok)
    assert (cached.eos_token_id, cached.bos_token_id, cached.vocab_size, cached.has_chat_template) == \
        (built.eos_token_id, built.bos_token_id, built.vocab_size, built.has_chat_template)
    for q in gsm8k_questions[:32] + ["法国的首都是哪里？ 🚀", "  leading spaces\tand\ttabs\n\n"]:
        assert cached.encode(q) == built.encode(q)
        chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q}]
        assert cached.apply_chat_template(chat) == built.apply_chat_template(chat)
        ids = built.apply_chat_template(chat)
        assert cached.decode(ids, skip_special_tokens=False) == built.decode(ids, skip_special_tokens=False)


def test_a_changed_model_file_gets_a_new_cache_entry_and_a_broken_entry_is_rebuilt(
        gguf_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copyfile(gguf_path, copy)
    first = _gguf_tokenizer_cache(str(copy))
    os.utime(copy, ns=(1, 1))
    assert _gguf_tokenizer_cache(str(copy)) != first
    reference = Tokenizer.from_gguf(str(copy))
    folder = _gguf_tokenizer_cache(str(copy))
    (folder / "tokenizer.json").write_text("{ not json")
    again = Tokenizer.from_gguf(str(copy))
    assert again.encode("Natalia sold clips to 48 of her friends") == \
        reference.encode("Natalia sold clips to 48 of her friends")
    assert (folder / "tokenizer.json").read_text().startswith("{")
    assert len((folder / "tokenizer.json").read_text()) > 1000  # rebuilt, not the damaged file
