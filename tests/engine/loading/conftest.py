"""Fixtures of the quantized-folder tests (test_hf_quantized.py, test_hf_quantized_kernels.py), built once per test
session: the real tokenizer, every case of quant_cases.CASES written as a folder, and the prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

NUM_PROMPTS = 16


@pytest.fixture(scope="session")
def hf_tok(gguf_path: str):
    from engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path).hf_tokenizer


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory, hf_tok) -> dict:
    """case -> (folder, {checkpoint module: reference fp32 weight}, HF fp32 model holding the reference weights)."""
    import copy

    transformers = pytest.importorskip("transformers")
    import quant_cases
    import quant_writers

    root, out = tmp_path_factory.mktemp("quantized"), {}
    base = {family: quant_cases.hf_model(transformers, family, len(hf_tok)) for family in ("llama", "qwen2")}
    for case, (family, (method, config, layer), _, _) in quant_cases.CASES.items():
        model = copy.deepcopy(base[family])
        refs = quant_writers.write_quantized(root / case, model, hf_tok, method, config, layer)
        with torch.no_grad():
            for module, w in refs.items():
                model.get_submodule(module).weight.copy_(w)
        out[case] = (root / case, refs, model)
    return out


@pytest.fixture(scope="session")
def prompt_ids(hf_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    """16 real prompts (8 GSM8K questions, 8 AlpacaEval instructions) in the chat template, as token ids."""
    texts = gsm8k_questions[:NUM_PROMPTS // 2] + alpaca_instructions[:NUM_PROMPTS // 2]
    return [hf_tok.encode(hf_tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False) for t in texts]


@pytest.fixture()
def quant_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TOKENMILL_CACHE_DIR in this session's temporary folder: the quantized folders' weights-cache entries
    (engine.loading.stored_cache) are written there, not into the user's cache."""
    root = tmp_path_factory.getbasetemp() / "tokenmill-cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(root))
    return root
