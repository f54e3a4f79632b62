"""Fixtures of the embedding tests (the default embedding model's folder: tests/conftest.py `minilm_folder`): 512
real texts, 256 GSM8K questions and 256 AlpacaEval instructions (the 16 longest by characters, which run past
the model's max_seq_length, and the first 240 others in file order)."""

from __future__ import annotations

import pytest

NUM_TEXTS = 512


@pytest.fixture(scope="session")
def embed_texts(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    """NUM_TEXTS real texts, GSM8K questions and AlpacaEval instructions alternating."""
    half = NUM_TEXTS // 2
    longest = sorted(range(len(alpaca_instructions)), key=lambda i: -len(alpaca_instructions[i]))[:16]
    rest = [i for i in range(len(alpaca_instructions)) if i not in set(longest)][:half - len(longest)]
    alpaca = [alpaca_instructions[i] for i in sorted(longest + rest)]
    return [t for pair in zip(gsm8k_questions[:half], alpaca, strict=True) for t in pair]
