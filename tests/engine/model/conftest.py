"""Fixtures of the family tests in new files (test_gemma.py, test_phi3.py): the real SmolLM2 tokenizer, its GGUF
tokenizer fields and 16 real chat-templated prompts (8 GSM8K questions, 8 AlpacaEval instructions)."""

from __future__ import annotations

import pytest

NUM_PROMPTS = 16


@pytest.fixture(scope="session")
def family_tok(gguf_path: str):
    from engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path).hf_tokenizer


@pytest.fixture(scope="session")
def tok_fields(gguf_path: str) -> list:
    from family_models import tokenizer_fields

    return tokenizer_fields(gguf_path)


@pytest.fixture(scope="session")
def hf_tok(family_tok):
    """The same tokenizer under the name the Llama-family, MoE and gpt-oss tests use."""
    return family_tok


@pytest.fixture(scope="session")
def family_prompts(family_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    from family_models import chat_prompt_ids

    return chat_prompt_ids(family_tok, gsm8k_questions, alpaca_instructions, NUM_PROMPTS)
