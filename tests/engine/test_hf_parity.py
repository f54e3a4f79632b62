"""Greedy output of our engine is token-identical to HF transformers loading the same GGUF (fp32, CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

NUM_PROMPTS = 32
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model_and_tokenizer(gguf_path: str):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model, tok


def test_greedy_matches_hf_with_preemption(gguf_path: str, gsm8k_questions: list[str], hf_model_and_tokenizer) -> None:
    prompts = gsm8k_questions[:NUM_PROMPTS]
    # Small blocks so every prompt spans many of them; a pool far smaller than the batch needs, so the scheduler
    # must preempt and recompute.
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=400, max_num_seqs=32,
                       max_num_batched_tokens=512)
    engine = LLMEngine.from_model(gguf_path, cfg)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = engine.generate(prompts, params)

    assert engine.scheduler.num_preemptions >= 1
    assert all(o.num_prompt_tokens > 3 * cfg.block_size for o in outs)
    engine.kv_cache_manager.check_integrity()
    assert engine.kv_cache_manager.num_free_blocks == cfg.num_kv_blocks  # nothing leaked after a full run

    model, tok = hf_model_and_tokenizer
    mismatches = []
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=False)
        input_ids = tok(ids, add_special_tokens=False, return_tensors="pt").input_ids
        assert input_ids[0].tolist() == out.prompt_token_ids
        with torch.inference_mode():
            ref = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        ref_ids = ref[0, input_ids.shape[1]:].tolist()
        if ref_ids != out.output_token_ids:
            mismatches.append((prompt[:40], ref_ids, out.output_token_ids))
    assert not mismatches, mismatches
