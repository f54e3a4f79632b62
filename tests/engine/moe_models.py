"""Tiny random-weight mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) built by HF transformers from each
family's config class (2 layers, hidden 64, 8 experts, top-2; Qwen3-MoE with norm_topk_prob and q/k norms, Qwen2-MoE
with its gated shared expert and QKV bias, Mixtral with a sliding window shorter than the prompts), saved with
save_pretrained (per-expert tensors, as real checkpoints hold them) beside the real SmolLM2 tokenizer, and written as
GGUF in the layout llama.cpp's convert_hf_to_gguf.py writes (experts stacked into blk.N.ffn_{gate,up,down}_exps,
the router as ffn_gate_inp, Mixtral as "llama" with permuted Q/K), their expert tensors in any GGUF type; and an HF
model holding given weights (a quantized model's, dequantized: the reference of the quantized tests). Used by
tests/engine/model/test_moe_families.py and test_moe_quantized.py.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch
from family_models import finish_gguf
from llama_family_models import permute, randomize, tokenizer_fields

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
             tie_word_embeddings=False)


def hf_config(family: str, vocab: int, tie: bool = False, width: int = 48):
    """The family's HF config (module docstring); `tie`: tied embeddings (a plain LM head under INT4 on load, whose
    round-to-nearest fit of 49k rows would cost seconds); `width`: the Qwen experts' moe_intermediate_size (48: a
    down projection whose input is not whole groups of 32)."""
    import transformers

    shape = dict(SHAPE, tie_word_embeddings=tie)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(vocab_size=vocab, num_experts=8, moe_intermediate_size=width, head_dim=32,
                                           norm_topk_prob=True, rope_theta=1e6, **shape)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(vocab_size=vocab, num_experts=8, moe_intermediate_size=width,
                                           shared_expert_intermediate_size=80, rope_theta=1e6, **shape)
    if family == "mixtral":
        return transformers.MixtralConfig(vocab_size=vocab, num_local_experts=8, sliding_window=24, rope_theta=1e6,
                                          **shape)
    raise AssertionError(family)


def write_moe_gguf(path: Path, family: str, folder: Path, tokenizer_gguf: str,
                   expert_type: object = None, weights_norm: bool | None = None, down_type: object = None) -> None:
    """The HF folder's model as llama.cpp's converter writes it (F32, or the stacked gate/up expert tensors in
    `expert_type` and the down ones in `down_type`, gguf.GGMLQuantizationType values gguf-py quantizes), with the
    tokenizer fields of `tokenizer_gguf`; `weights_norm`: an `{arch}.expert_weights_norm` field (the converter writes
    none for these families)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[family]
    heads, kv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if weights_norm is not None:
        w.add_expert_weights_norm(weights_norm)
    for name, value, vtype, sub in tokenizer_fields(tokenizer_gguf):
        w.add_key_value(name, value, vtype, sub_type=sub)
    tmap = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    tensors, per_expert = {}, {}
    for name, t in load_file(folder / "model.safetensors").items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:  # the converter stacks a layer's experts per projection
            per_expert.setdefault((int(m[1]), m[2], m[4]), {})[int(m[3])] = t.numpy()
            continue
        a = t.numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, kv)
        tensors[tmap.get_name(name, try_suffixes=(".weight", ".bias"))] = a
    for (bid, block, proj), parts in per_expert.items():
        merged = (f"layers.{bid}.feed_forward.experts.{proj}" if block == "block_sparse_moe"
                  else f"model.layers.{bid}.mlp.experts.{proj}")
        tensors[tmap.get_name(f"{merged}.weight", try_suffixes=(".weight",))] = np.stack(
            [parts[e] for e in range(experts)])
    def kind(name: str) -> object:
        return (expert_type if name.endswith(("gate_exps.weight", "up_exps.weight")) else
                down_type if name.endswith("down_exps.weight") else None)

    finish_gguf(w, {name: (a, gguf.GGMLQuantizationType.F32) if kind(name) is None else
                    (gguf.quants.quantize(np.ascontiguousarray(a, np.float32), kind(name)), kind(name))
                    for name, a in tensors.items()})



def build_moe_families(root: Path, gguf_path: str, hf_tok, tie: bool = False, width: int = 48,
                       gguf_families: Collection[str] = FAMILIES) -> dict[str, tuple]:
    """{family: (HF model fp32, HF folder, GGUF file F32)} of the tiny models (module docstring; `tie`, `width`: as
    hf_config), under `root`. Only the families in `gguf_families` get their GGUF file (0.4 CPU-s each), the others
    None in its place."""
    import transformers

    out = {}
    for seed, family in enumerate(FAMILIES):
        torch.manual_seed(10 + seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config(family, len(hf_tok), tie, width),
                                                              dtype=torch.float32).eval()
        randomize(model)
        folder = root / family
        model.save_pretrained(folder)
        hf_tok.save_pretrained(folder)
        path = root / f"{family}.gguf" if family in gguf_families else None
        if path is not None:
            write_moe_gguf(path, family, folder, gguf_path)
        out[family] = (model, folder, path)
    return out


def hf_holding(model, ours: dict[str, torch.Tensor]):
    """A copy of the HF MoE `model` holding `ours` (our parameter names, fp32: e.g. a quantized state dequantized by
    engine.quant.handler.dequantize_state_dict): HF's stacked experts.gate_up_proj [E, 2I, H] from our gate_proj and
    up_proj [E, I, H], every other parameter under its own name. Raises KeyError for a parameter `ours` lacks."""
    ref = copy.deepcopy(model)
    state = {}
    for key in ref.state_dict():
        name = key.removeprefix("model.")
        if name.endswith("experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            state[key] = torch.cat([ours[f"{stem}gate_proj.weight"], ours[f"{stem}up_proj.weight"]], dim=1)
        elif name.endswith("experts.down_proj"):
            state[key] = ours[f"{name}.weight"]
        elif name == "lm_head.weight" and ref.config.tie_word_embeddings:
            state[key] = ours["embed_tokens.weight"]
        else:
            state[key] = ours[name]
    ref.load_state_dict(state)
    return ref
