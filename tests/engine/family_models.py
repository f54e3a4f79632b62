"""Tiny random-weight models of the Gemma 2, Gemma 3 text and Phi-3 families, built by HF transformers from each
family's own config class with its special fields switched on (small sliding windows that the chat-templated
prompts cross, strong soft-caps, a local and a global RoPE base, LongRoPE past a short original context, and as
"phi4mini" Phi-4-mini's partial rotary), saved as HF folders beside the real SmolLM2 tokenizer and written as GGUF
in the layout llama.cpp's convert_hf_to_gguf.py writes (Gemma's norms stored as 1 + weight; Phi-3's fused
attn_qkv / ffn_up, its rope_factors_long / _short, the rotated dims as rope.dimension_count and no key_length).
Used by tests/engine/model/test_gemma.py and test_phi3.py.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf_models import finish_gguf  # tests/gguf_models.py; the family writers take it from here
from gguf_models import tokenizer_fields as read_tokenizer_fields

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GGUF_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "phi4mini": "phi3"}
SEEDS = {"gemma2": 21, "gemma3_text": 1, "phi3": 25, "phi4mini": 7}
WINDOW = 24  # tokens: shorter than every chat-templated prompt, so the sliding layers must apply it


def hf_config(family: str, vocab: int):
    """The family's HF config with its special fields on."""
    import transformers

    if family == "gemma2":
        # caps low enough that tiny random scores and logits reach them; query_pre_attn_scalar = head_dim (what a
        # GGUF implies for non-27B models)
        return transformers.Gemma2Config(vocab_size=vocab, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                                         query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=5.0, **SHAPE)
    if family == "gemma3_text":
        # 6 layers: the default pattern (5 sliding, 1 global) that llama.cpp assumes for Gemma 3 GGUFs; the global
        # layer's RoPE linearly scaled, the sliding ones on the local base
        return transformers.Gemma3TextConfig(vocab_size=vocab, num_hidden_layers=6, head_dim=16,
                                             sliding_window=WINDOW, query_pre_attn_scalar=16,
                                             final_logit_softcapping=5.0, **SHAPE,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})
    if family == "phi3":
        # LongRoPE with an original context of 32 tokens: every prompt is longer, so HF uses the long factors, as
        # the engine does for a row past the original one
        half = 16 // 2
        return transformers.Phi3Config(vocab_size=vocab, num_hidden_layers=2, sliding_window=28,
                                       original_max_position_embeddings=32, tie_word_embeddings=False, **SHAPE,
                                       rope_scaling={"type": "longrope",
                                                     "short_factor": [1.0 + 0.2 * i for i in range(half)],
                                                     "long_factor": [1.5 + 0.7 * i for i in range(half)]})
    if family == "phi4mini":
        # Phi-4-mini's shape of the family: partial rotary (12 of 16 dims rotate), LongRoPE factors for those 12,
        # tied embeddings, no window
        half = 16 * 3 // 4 // 2
        return transformers.Phi3Config(vocab_size=vocab, num_hidden_layers=2, sliding_window=None,
                                       original_max_position_embeddings=32, tie_word_embeddings=True, **SHAPE,
                                       partial_rotary_factor=0.75,
                                       rope_scaling={"type": "longrope",
                                                     "short_factor": [1.0 + 0.3 * i for i in range(half)],
                                                     "long_factor": [1.2 + 0.8 * i for i in range(half)]})
    raise AssertionError(family)


def build_hf(family: str, vocab: int):
    """A tiny fp32 eager HF model of `family` with weights large enough that greedy output varies; Gemma's norm
    weights (which multiply by 1 + weight) centred on 0, the others on 1, and its embeddings (scaled by
    sqrt(hidden) and tied to the LM head) smaller, so the greedy token is not the last one again."""
    import transformers

    torch.manual_seed(SEEDS[family])
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, vocab), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn_like(p))
            elif gemma and "embed_tokens" in name:  # Gemma scales embeddings by sqrt(hidden): keep layers audible
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 0.15)
    return model


def save_folder(model, folder: Path, hf_tok) -> Path:
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


@functools.cache
def tokenizer_fields(tokenizer_gguf: str) -> tuple[tuple, ...]:
    """(key, value, type, sub_type) of every tokenizer.* field of a GGUF file, read once per test process (its 49k
    strings and merges take about 0.25 CPU-s to parse and decode; the writers only read them).
    gguf_models.tokenizer_fields reads them: through the engine's GGUF reader, whose fields are GGUFReader's
    (test_weights_cache.py)."""
    return tuple(read_tokenizer_fields(tokenizer_gguf))


def write_gguf(path: Path, family: str, model, tok_fields: list, q4_0: tuple[str, ...] = ()) -> None:
    """The model as llama.cpp's converter writes it (F32 tensors, those whose GGUF name contains one of `q4_0` in
    Q4_0): Gemma's norms + 1, soft-caps and window; Phi-3's fused tensors under attn_qkv / ffn_up, its LongRoPE
    factors, original context and attention factor."""
    import gguf

    cfg, arch = model.config, GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if GGUF_ARCH[family] != "phi3":  # llama.cpp's Phi3MiniModel writes no key_length: head_dim is hidden / heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_sliding_window(cfg.sliding_window or 0)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    tensors = {}
    if family == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if family.startswith("gemma") and cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if GGUF_ARCH[family] == "phi3":  # rope.dimension_count: the rotated dims, int(factor * hidden) // heads
        orig = rope["original_max_position_embeddings"]
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size)
                                   // cfg.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    for name, value, vtype, sub in tok_fields:
        w.add_key_value(name, value, vtype, sub_type=sub)
    tmap = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if family.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1.0
        tensors[tmap.get_name(name, try_suffixes=(".weight", ".bias"))] = a
    q4, f32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    finish_gguf(w, {name: (gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), q4), q4)
                       if any(part in name for part in q4_0) else (a, f32) for name, a in tensors.items()})


def hf_argmax(model, prompt_ids: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """HF's greedy choice at each position of `outputs` given its prompt and the output tokens before it (one
    forward per prompt): equals `outputs` exactly when HF's greedy generation does (test_hf_parity.py argues). The
    LM head runs only at those positions (HF's `logits_to_keep`, as its generate() does; on a tiny model with SmolLM2's
    49k vocabulary it is most of the forward)."""
    out = []
    with torch.no_grad():
        for ids, seq in zip(prompt_ids, outputs, strict=True):
            logits = model(torch.tensor([ids + seq]), logits_to_keep=len(seq) + 1).logits[0, :-1]
            out.append(logits.argmax(-1).tolist())
    return out


def assert_hf_greedy(model, prompt_ids: list[list[int]], outputs: list[list[int]], rel: float = 1e-3) -> None:
    """Each token of `outputs` is HF's greedy choice given its prompt and the tokens before it (teacher-forced), or,
    at one position in 100 at most, within `rel` (relative) of HF's largest logit there: a near tie that the
    arithmetic's rounding flips. fp32 summed in other orders (CUDA's kernels, another CPU kind's GEMMs) moves a logit
    by ~1e-4 relative; W8A8 activations rounded per token turn such a difference into a whole rounding step of one
    input (a few 1e-3 seen: rel=5e-3 there); a wrong weight, bias or expert is off by tenths or units."""
    near, total = 0, 0
    with torch.no_grad():
        for ids, seq in zip(prompt_ids, outputs, strict=True):
            logits = model(torch.tensor([ids + seq]), logits_to_keep=len(seq) + 1).logits[0, :-1]  # as hf_argmax
            best = logits.max(-1).values
            gap = best - logits.gather(-1, torch.tensor(seq)[:, None])[:, 0]
            assert bool((gap <= rel * best.abs().clamp(min=1.0)).all()), gap.max().item()
            near, total = near + int((gap > 0).sum()), total + len(seq)
    assert near <= total // 100, (near, total)


def hf_generate(model, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF `generate`'s greedy tokens (no EOS stop)."""
    import transformers

    gen = transformers.GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), generation_config=gen)[0, len(ids):].tolist() for ids in prompt_ids]


def chat_prompt_ids(tok, gsm8k_questions: list[str], alpaca_instructions: list[str], n: int) -> list[list[int]]:
    """Token ids of n real chat-templated prompts (n // 2 GSM8K questions, n // 2 AlpacaEval instructions) under the
    HF tokenizer `tok`'s chat template, with the generation prompt."""
    texts = gsm8k_questions[:n // 2] + alpaca_instructions[:n // 2]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False) for t in texts]
