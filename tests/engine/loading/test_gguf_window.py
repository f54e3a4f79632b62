"""A Mistral GGUF from llama.cpp's converter (architecture llama, no sliding-window key) runs with full attention:
engine.loading.gguf_config warns once per model name, only for files whose metadata names Mistral."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.loading import gguf_config, gguf_file


def _write(path: Path, name: str, window: int | None) -> str:
    """A header-only llama GGUF (one tiny tensor) named `name`, with `window` as its sliding window when given."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    for key, value in (("embedding_length", 64), ("block_count", 1), ("feed_forward_length", 128),
                       ("context_length", 32768), ("vocab_size", 32000)):
        w.add_uint32(f"llama.{key}", value)
    w.add_uint32("llama.attention.head_count", 4)
    if window is not None:
        w.add_uint32("llama.attention.sliding_window", window)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(("name", "window", "warns"), [
    ("Mistral-7B-Instruct-v0.1", None, True),      # llama.cpp's conversion: the window is gone
    ("Mistral-7B-Instruct-v0.1", 4096, False),     # a file that kept it runs it
    ("SmolLM2-135M-Instruct", None, False),        # a Llama: no window to lose
])
def test_a_mistral_gguf_without_its_window_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 name: str, window: int | None, warns: bool) -> None:
    gguf_config._warn_mistral_without_window.cache_clear()
    path = _write(tmp_path / "m.gguf", name, window)
    with caplog.at_level(logging.WARNING, logger=gguf_config.__name__):
        configs = [gguf_file.read_gguf_config(gguf_file.open_gguf(path)) for _ in range(2)]
    assert all(c.sliding_window == window for c in configs)
    warned = [r.getMessage() for r in caplog.records if r.name == gguf_config.__name__]
    assert len(warned) == int(warns), warned  # once, though the file was read twice
    if warns:
        assert name in warned[0] and "full attention" in warned[0] and "4096" in warned[0]
