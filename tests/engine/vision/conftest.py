"""Fixtures of the vision-language tests: the tiny LLaVA folder (tests/engine/llava_models.py) written once per
session, its HF model and processor (the reference), tokenmill's engine over it, and real questions."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llava_folder(tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    """(folder, HF model) of the tiny LLaVA."""
    from llava_models import build_llava

    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-llava")
    model = build_llava(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer)
    return folder, model


@pytest.fixture(scope="session")
def hf_llava(llava_folder):
    """(HF LlavaForConditionalGeneration fp32, its LlavaProcessor) loaded from the folder, as a user would."""
    import transformers

    folder, _ = llava_folder
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype="float32",
                                                                       attn_implementation="eager").eval()
    return model, transformers.AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="session")
def llava_engine(llava_folder):
    """tokenmill's engine over the tiny LLaVA folder (CPU, fp32, prefix caching on)."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine.from_model(str(llava_folder[0]), EngineConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def questions(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    """Real questions: 4 short GSM8K questions and 4 AlpacaEval instructions (the shortest: a fast prefill)."""
    return sorted(gsm8k_questions, key=len)[:4] + sorted(alpaca_instructions, key=len)[10:14]
