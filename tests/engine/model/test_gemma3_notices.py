"""What a Gemma 3 load says (issue 51, item 9): a Gemma 3 GGUF warns that it runs llama.cpp's layer pattern and
query scale (the file stores neither). The multimodal checkpoint, once refused, runs (tests/engine/vision/
test_gemma3_vl.py)."""

from __future__ import annotations

import logging

import pytest

from engine.model.family_fields import _warn_gemma3_gguf, gemma_gguf_fields


def test_gemma3_gguf_warns_once_of_llama_cpp_pattern_and_query_scale(caplog: pytest.LogCaptureFixture) -> None:
    meta = {"attention.sliding_window": 512}
    _warn_gemma3_gguf.cache_clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            fields = gemma_gguf_fields(lambda k, d: meta.get(k, d), layers=26, hidden=1152, heads=4, head_dim=256,
                                       gemma3=True)
        gemma_gguf_fields(lambda k, d: meta.get(k, d), layers=26, hidden=1152, heads=4, head_dim=256, gemma3=False)
    warned = [r.getMessage() for r in caplog.records if "Gemma 3 GGUF" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0]
    assert "5 sliding layers then 1 global" in warned[0] and "query_pre_attn_scalar 256" in warned[0]
    assert fields["query_pre_attn_scalar"] == 256.0
