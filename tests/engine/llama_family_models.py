"""Tiny random-weight models of the Llama-shaped families (llama, qwen2, qwen3, mistral), built by HF transformers from
each family's own config class with its special fields switched on (Llama 3 RoPE scaling with a short original
context, Qwen2 QKV bias with YaRN, Qwen3 q/k norms with head_dim != hidden / heads, Mistral with a short window and
linear RoPE scaling), saved as HF folders beside the real SmolLM2 tokenizer and written as GGUF in the layout
llama.cpp's convert_hf_to_gguf.py writes (permuted Q/K for llama/mistral, rope_freqs for Llama 3); and the greedy runs
of ours and HF's that compare them. Used by tests/engine/model/test_families.py, test_family_cli_checks.py,
test_moe_families.py and tests/engine/kernels/test_gguf_small_batch.py.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from family_models import finish_gguf, hf_argmax, hf_generate, tokenizer_fields

from engine import EngineConfig, LLMEngine, SamplingParams

__all__ = ["FAMILIES", "FP32", "MAX_TOKENS", "build_family", "copy_folder", "edit_config", "hf_argmax", "hf_greedy",
           "our_greedy", "permute", "tokenizer_fields", "write_gguf"]

MAX_TOKENS = 32
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def hf_config(family: str, vocab: int):
    """The family's HF config with its special fields on."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=False, **SHAPE,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if family == "qwen2":
        return transformers.Qwen2Config(vocab_size=vocab, rope_theta=1e6, tie_word_embeddings=True,
                                        use_sliding_window=False, **SHAPE,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if family == "qwen3":
        return transformers.Qwen3Config(vocab_size=vocab, rope_theta=1e6, head_dim=32, tie_word_embeddings=False,
                                        use_sliding_window=False, **SHAPE)
    if family == "mistral":
        # A window shorter than every chat-templated prompt: the attention paths must apply it
        # (engine.layers.attention).
        return transformers.MistralConfig(vocab_size=vocab, rope_theta=1e6, sliding_window=24, head_dim=16,
                                          tie_word_embeddings=False, **SHAPE,
                                          rope_scaling={"rope_type": "linear", "factor": 2.0})
    raise AssertionError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half Q/K rows to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3's rope_freqs."""
    rs = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rs["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old, low, high, factor = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                              rs["high_freq_factor"], rs["factor"])
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: Path, family: str, model, tokenizer_gguf: str, extra: dict[str, np.ndarray] | None = None,
               quantized: dict[str, tuple[np.ndarray, object]] | None = None) -> None:
    """The model as llama.cpp's converter writes it (F32 tensors), with the tokenizer fields of `tokenizer_gguf`;
    `quantized` (GGUF name -> (raw bytes [N, row bytes], gguf.GGMLQuantizationType)) replaces those tensors."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    rs = cfg.rope_parameters
    if rs.get("rope_type") in ("linear", "yarn"):
        kind = gguf.RopeScalingType.LINEAR if rs["rope_type"] == "linear" else gguf.RopeScalingType.YARN
        w.add_rope_scaling_type(kind)
        w.add_rope_scaling_factor(rs["factor"])
        if rs["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    for name, value, vtype, sub in tokenizer_fields(tokenizer_gguf):
        w.add_key_value(name, value, vtype, sub_type=sub)
    tmap = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], cfg.num_hidden_layers)
    tensors = {}
    if rs.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(cfg)
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, kv)
        tensors[tmap.get_name(name, try_suffixes=(".weight", ".bias"))] = a
    tensors.update(extra or {})
    finish_gguf(w, {name: (quantized or {}).get(name) or (a, gguf.GGMLQuantizationType.F32)
                    for name, a in tensors.items()})


def randomize(model) -> None:
    """Random weights at a scale that gives varied greedy text (and routing): norms around 1, biases, attention sinks
    and q/k norms random so they matter, every other weight N(0, 0.15)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)


def build_family(root: Path, family: str, gguf_path: str, hf_tok) -> tuple[object, Path, Path]:
    """(HF model fp32, HF folder, GGUF file) of a tiny random model of `family`."""
    import transformers

    cfg = hf_config(family, len(hf_tok))
    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3, "mistral": 4}[family])
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize(model)
    folder = root / family
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    gen = {"eos_token_id": [2, 0], "bos_token_id": 1} if family == "llama" else {"eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    path = root / f"{family}.gguf"
    write_gguf(path, family, model, gguf_path)
    return model, folder, path


def hf_greedy(model, prompt_ids: list[list[int]]) -> list[list[int]]:
    """HF `generate`'s greedy MAX_TOKENS tokens per prompt (no EOS stop)."""
    return hf_generate(model, prompt_ids, MAX_TOKENS)


def copy_folder(folder: Path, tmp_path: Path) -> Path:
    """A copy of a model folder under tmp_path/model, for a test to change."""
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    return out


def edit_config(folder: Path, **changes: object) -> None:
    """Set `changes` in the folder's config.json."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


FP32 = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=16,
                    max_num_batched_tokens=512)


def our_greedy(model: str, prompt_ids: list[list[int]], config: EngineConfig = FP32) -> list[list[int]]:
    """Our greedy MAX_TOKENS tokens per prompt (no EOS stop) from a model path, in fp32 on the CPU."""
    engine = LLMEngine.from_model(model, config)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]
