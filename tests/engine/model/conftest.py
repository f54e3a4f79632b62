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
def family_prompts(family_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    texts = gsm8k_questions[:NUM_PROMPTS // 2] + alpaca_instructions[:NUM_PROMPTS // 2]
    return [family_tok.encode(family_tok.apply_chat_template([{"role": "user", "content": t}],
                                                             add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False) for t in texts]
