"""Fixtures of the family tests in new files (test_gemma.py, test_phi3.py): the real SmolLM2 tokenizer, its GGUF
tokenizer fields and 16 real chat-templated prompts (8 GSM8K questions, 8 AlpacaEval instructions); the quantized
mixture-of-experts tests' tiny MoE models and their 8 prompts."""

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


@pytest.fixture(scope="session")
def moe_tied(tmp_path_factory: pytest.TempPathFactory, gguf_path: str, hf_tok) -> dict[str, tuple]:
    """{family: (HF model fp32, HF folder, GGUF file)} of tests/engine/moe_models.py's tiny MoE families with tied
    embeddings (test_moe_quantized.py, test_moe_int4_cuda.py); only Mixtral's GGUF file is written (the one these
    tests load), the others are None."""
    from moe_models import build_moe_families

    return build_moe_families(tmp_path_factory.mktemp("moe-tied"), gguf_path, hf_tok, tie=True,
                              gguf_families=("mixtral",))


@pytest.fixture(scope="session")
def moe_prompt_ids(hf_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    """8 real chat-templated prompts for the MoE tests (4 GSM8K questions, 4 AlpacaEval instructions)."""
    from family_models import chat_prompt_ids

    return chat_prompt_ids(hf_tok, gsm8k_questions, alpaca_instructions, 8)
