"""Sliding-window attention (Mistral): the torch reference against a dense masked oracle, the config's validation,
and greedy generation token-identical to HF transformers' MistralForCausalLM on real prompts longer than the window,
on the torch and the C++ CPU backends, with chunked prefill and prefix caching. (The C++ kernel's own window tests
are in test_cpu_kernels.py, the Triton kernels' in test_triton_attention.py.)"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from attention_steps import dense_attention, make_step

from engine import EngineConfig, SamplingParams
from engine.config import ModelConfig
from engine.layers.attention import paged_attention_cpu, paged_attention_ref
from engine.text.tokenizer import Tokenizer

NUM_PROMPTS = 16
MAX_TOKENS = 32
NUM_GENERATE = 4  # prompts that also go through HF's generate()

# (query_lens, seq_lens): decode only; decodes then a chunked and a full prefill; one long chunk after a context.
STEPS = [([1] * 5, [1, 13, 16, 37, 70]), ([1, 1, 1, 21, 40], [9, 33, 120, 30, 40]), ([30], [75])]
# Smaller than a block, equal to one, not a multiple of the block sizes, longer than every sequence; 1 = itself.
WINDOWS = [1, 5, 8, 24, 37, 1000]


def test_model_config_validates_the_window() -> None:
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=4)
    assert ModelConfig(**base).sliding_window is None
    assert ModelConfig(**base, sliding_window=4096).sliding_window == 4096
    for bad in (0, -3, 2.5, True, "24"):
        with pytest.raises(ValueError, match="sliding_window"):
            ModelConfig(**base, sliding_window=bad)
    fields = dataclasses.fields(ModelConfig)  # the fields after it (later families') all have defaults
    after = fields[[f.name for f in fields].index("sliding_window"):]
    assert all(f.default is not dataclasses.MISSING for f in after)


def test_attention_functions_reject_a_bad_window() -> None:
    q, kc, vc, meta = make_step([1, 4], [5, 9], 4, 2, 4, torch.float32)
    for fn in (paged_attention_ref, paged_attention_cpu):
        with pytest.raises(ValueError, match="sliding_window"):
            fn(q, kc, vc, meta, 0.25, sliding_window=0)


def test_dense_oracle_is_full_causal_attention_for_a_long_window() -> None:
    q, kc, vc, meta = make_step(*STEPS[1], 6, 2, 8, torch.float32)
    full = dense_attention(q, kc, vc, meta, 0.125)
    assert torch.equal(dense_attention(q, kc, vc, meta, 0.125, 120), full)
    assert not torch.allclose(dense_attention(q, kc, vc, meta, 0.125, 119), full)
    # A window of one key: each query reads only its own value.
    own = dense_attention(q, kc, vc, meta, 0.125, 1)
    last = meta.block_tables[4, 39 // 8].item() * 8 + 39 % 8
    assert torch.allclose(own[-1], vc.view(-1, 2, 64)[last].repeat_interleave(3, dim=0))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("step", STEPS)
def test_reference_matches_the_dense_oracle(window: int, num_heads: int, num_kv_heads: int, block_size: int,
                                            step: tuple[list[int], list[int]]) -> None:
    q, kc, vc, meta = make_step(*step, num_heads, num_kv_heads, block_size, torch.float32)
    out = paged_attention_ref(q, kc, vc, meta, 0.125, sliding_window=window)
    assert (out - dense_attention(q, kc, vc, meta, 0.125, window)).abs().max().item() < 2e-6
    # The plan is cached on the metadata per window: the full causal call after it is not windowed.
    full = paged_attention_ref(q, kc, vc, meta, 0.125)
    assert (full - dense_attention(q, kc, vc, meta, 0.125)).abs().max().item() < 2e-6


def test_cpu_path_with_long_chunks_applies_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # Decodes in the C++ kernel, the prefill chunk through the reference's SDPA (the long-chunk split).
    monkeypatch.setattr("engine.layers.attention.CPU_KERNEL_MAX_PREFILL_PAIRS", 16)
    q, kc, vc, meta = make_step([1, 1, 30], [40, 9, 75], 6, 2, 8, torch.float32)
    out = paged_attention_cpu(q, kc, vc, meta, 0.125, sliding_window=13)
    assert (out - dense_attention(q, kc, vc, meta, 0.125, 13)).abs().max().item() < 2e-5


@pytest.fixture(scope="module")
def tokenizer(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_mistral(tokenizer: Tokenizer):
    pytest.importorskip("transformers")
    from tiny_mistral import build_hf_mistral

    return build_hf_mistral(49152, 1, tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def prompts(gsm8k_questions: list[str]) -> list[str]:
    return gsm8k_questions[:NUM_PROMPTS]


@pytest.mark.parametrize(("backend", "block_size", "max_num_batched_tokens"),
                         [("torch", 16, 2048), ("cpu", 16, 2048), ("cpu", 8, 40), ("torch", 8, 40)])
def test_greedy_matches_hf_mistral(hf_mistral, tokenizer: Tokenizer, prompts: list[str], backend: str,
                                   block_size: int, max_num_batched_tokens: int) -> None:
    from tiny_mistral import mismatches, our_engine

    cfg = EngineConfig(device="cpu", dtype="float32", attention_backend=backend, block_size=block_size,
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=NUM_PROMPTS)
    engine = our_engine(hf_mistral, tokenizer, cfg)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    if max_num_batched_tokens < 2 * 24:
        assert all(o.num_prompt_tokens > max_num_batched_tokens for o in outs)  # every prompt prefilled in chunks
    # The prompts share the chat template's prefix: later ones reuse its cached KV blocks.
    assert engine.kv_cache_manager.pool.num_cache_hits > 0
    engine.kv_cache_manager.check_integrity()
    assert not mismatches(outs, hf_mistral, NUM_GENERATE)


def test_greedy_without_the_window_differs_from_hf_mistral(hf_mistral, tokenizer: Tokenizer,
                                                           prompts: list[str]) -> None:
    # The control: the same weights with full causal attention do not give HF Mistral's tokens, so the parity above
    # rests on the window.
    from tiny_mistral import mismatches, our_engine

    windowless = copy.deepcopy(hf_mistral.config)
    windowless.sliding_window = None
    full = type(hf_mistral)(windowless).eval()
    full.load_state_dict(hf_mistral.state_dict())
    engine = our_engine(full, tokenizer, EngineConfig(device="cpu", dtype="float32", attention_backend="cpu"))
    outs = engine.generate(prompts[:4], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert not mismatches(outs, full, 1)  # our full causal attention is HF's full causal attention...
    assert len(mismatches(outs, hf_mistral, 0)) >= 3  # ...and not HF Mistral's sliding window


@pytest.mark.gpu
def test_cuda_graphs_with_the_window_match_hf_mistral(hf_mistral, tokenizer: Tokenizer, prompts: list[str]) -> None:
    # On a GPU: the Triton kernels, decode replayed from CUDA graphs captured with the window baked in, fp32.
    from tiny_mistral import mismatches, our_engine

    engine = our_engine(hf_mistral, tokenizer, EngineConfig(device="cuda", dtype="float32", max_num_seqs=NUM_PROMPTS,
                                                            max_num_batched_tokens=64))
    assert engine.runner.attn_fn.__name__ == "paged_attention_triton" and engine.runner.graphs is not None
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert engine.runner.graphs.graphs, "decode steps never replayed a CUDA graph"
    assert not mismatches(outs, hf_mistral, NUM_GENERATE)
