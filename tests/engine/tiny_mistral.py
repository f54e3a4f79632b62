"""A tiny random MistralForCausalLM built by HF transformers (the reference) and the same weights in our LlamaModel,
shared by the sliding-window parity tests (tests/engine/layers/test_sliding_window.py, test_triton_attention.py)."""

from __future__ import annotations

import torch

from engine import EngineConfig, LLMEngine
from engine.config import ModelConfig
from engine.loading.presets import random_model
from engine.text.tokenizer import Tokenizer

# Shorter than every chat-templated gsm8k prompt (about 80-250 tokens), and not a multiple of the block sizes used.
SLIDING_WINDOW = 24


def build_hf_mistral(vocab_size: int, bos_token_id: int, eos_token_id: int, seed: int = 0):
    """A 2-layer GQA MistralForCausalLM (4 query heads, 2 KV heads of 16) with a SLIDING_WINDOW-token window, fp32,
    eager attention (its mask is the exact `sliding_window_overlay`), random weights of std 0.1 (wider than HF's
    0.02 default so greedy logits are far apart: no near-ties that fp32 rounding could flip)."""
    import transformers

    config = transformers.MistralConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
        sliding_window=SLIDING_WINDOW, tie_word_embeddings=False, initializer_range=0.1, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.MistralForCausalLM(config).eval()


def our_model_config(hf_config) -> ModelConfig:
    """The ModelConfig of an HF MistralConfig (the fields this tiny model sets)."""
    return ModelConfig(vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
                       intermediate_size=hf_config.intermediate_size, num_layers=hf_config.num_hidden_layers,
                       num_heads=hf_config.num_attention_heads, num_kv_heads=hf_config.num_key_value_heads,
                       head_dim=hf_config.head_dim, rope_theta=hf_config.rope_parameters["rope_theta"],
                       rms_norm_eps=hf_config.rms_norm_eps,
                       max_position_embeddings=hf_config.max_position_embeddings,
                       tie_word_embeddings=False, bos_token_id=hf_config.bos_token_id,
                       eos_token_id=hf_config.eos_token_id, sliding_window=hf_config.sliding_window)


def our_engine(hf_model, tokenizer: Tokenizer, config: EngineConfig) -> LLMEngine:
    """An fp32 LLMEngine on config.device ("cpu" or "cuda") over `hf_model`'s weights, copied into our LlamaModel
    (HF names minus "model.")."""
    cfg = our_model_config(hf_model.config)
    device = torch.device(config.device)
    model = random_model(cfg, torch.float32, device)
    state = {name.removeprefix("model."): w for name, w in hf_model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return LLMEngine(model, cfg, tokenizer, config, "tiny-mistral (random weights)", device, torch.float32)


def hf_greedy(hf_model, prompt_token_ids: list[int], max_tokens: int, eos_token_id: int) -> list[int]:
    """HF `generate`'s greedy continuation of one prompt (at most max_tokens, stopping after EOS)."""
    ids = torch.tensor([prompt_token_ids])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def mismatches(outs: list, hf_model, num_generate: int) -> list[tuple]:
    """Where HF's greedy choice differs from our greedy outputs `outs` (RequestOutputs of prompts longer than twice
    the window, else the check would prove nothing). For every prompt, HF's argmax at each output position given
    the prompt and our earlier tokens, in one forward pass (teacher forcing: HF's greedy output equals ours exactly
    when every such argmax is our token, by induction over the positions, as in test_hf_parity.py); for the first
    `num_generate` prompts also HF's own `generate` (its sliding-window KV cache and decode loop). Returns
    (kind, prompt index, HF tokens, ours) per mismatch."""
    bad = []
    for i, out in enumerate(outs):
        assert out.finish_reason in ("length", "stop"), out.error
        assert out.num_prompt_tokens > 2 * SLIDING_WINDOW
        ids, ours = out.prompt_token_ids, out.output_token_ids
        forced = _hf_call(hf_model, "forward", ids, ours)
        if forced != ours:
            bad.append(("forward", i, forced, ours))
        if i < num_generate:
            ref = _hf_call(hf_model, "generate", ids, ours)
            if ref != ours:
                bad.append(("generate", i, ref, ours))
    return bad


_HF_ANSWERS: dict[tuple, list[int]] = {}


def _hf_call(hf_model, kind: str, ids: list[int], ours: list[int]) -> list[int]:
    """HF's teacher-forced argmaxes ("forward") or `generate` output for (prompt, our tokens), memoized per model
    object so backends that agree pay for HF once."""
    key = (hf_model, kind, tuple(ids), tuple(ours))  # holds the model: its id is never reused
    if key not in _HF_ANSWERS:
        if kind == "forward":
            with torch.inference_mode():
                logits = hf_model(torch.tensor([ids + ours])).logits[0, len(ids) - 1:-1]
            _HF_ANSWERS[key] = logits.argmax(-1).tolist()
        else:
            _HF_ANSWERS[key] = hf_greedy(hf_model, ids, len(ours), hf_model.config.eos_token_id)
    return _HF_ANSWERS[key]
