"""Write a synthetic GPTQ checkpoint of a real big shape (Llama-3.1-70B, Qwen2.5-72B) for the one-GPU 70B run of
issue 42: random integers and scales in the GPTQ format, shard by shard, never a bf16 copy of a quantized layer.

    python -m bench.big_checkpoint /tmp/big-gptq --shape llama-3.1-70b      # about 39 GB on disk
    python -m bench.big_checkpoint /tmp/tiny-gptq --shape tiny              # what the tests write

Format (AutoGPTQ / GPTQModel `QuantLinear.pack`, `quant_method: gptq`, checkpoint format v1; what
engine.loading.gptq_awq reads): bits 4, group_size 128, sym, desc_act false. Per projection of out_features N and
in_features K: qweight int32 [K / 8, N] (input feature k of column n in bits 4 * (k % 8) of word [k // 8, n]: random
words, so every nibble is uniform in 0..15), qzeros int32 [K / 128, N / 8] (sym: the zero point 8 stored as
8 - 1 = 7 in every nibble, v1), scales fp16 [K / 128, N], g_idx int32 [K] = k // 128 (desc_act false). Embedding,
LM head, norms (and Qwen2's q/k/v biases) in fp16, as GPTQ checkpoints keep them. config.json is the model's own
with its quantization_config; the tokenizer is SmolLM2's (the vocabulary is the real shape's; token ids past
SmolLM2's 49,152 are never prompted). Shards of about --shard-gb GB with model.safetensors.index.json; the largest
tensor held at once is the LM head's fp16 (128256 x 8192: 2.1 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

GROUP, BITS = 128, 4
PER_WORD = 32 // BITS
SYM_ZEROS_V1 = 0x77777777  # eight nibbles of 8 - 1: GPTQ v1 stores the zero point minus one

#: config.json of each shape (meta-llama/Llama-3.1-70B-Instruct, Qwen/Qwen2.5-72B-Instruct; "tiny": the tests').
SHAPES: dict[str, dict] = {
    "llama-3.1-70b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                      "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
                      "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    "qwen2.5-72b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
                    "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
                    "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645},
    "tiny": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
             "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 49152, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
}
QUANTIZATION_CONFIG = {"quant_method": "gptq", "bits": BITS, "group_size": GROUP, "sym": True, "desc_act": False,
                       "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}


def gptq_layer(n: int, k: int, gen: torch.Generator, scale: float) -> dict[str, torch.Tensor]:
    """One GPTQ projection [N, K] (module docstring): random packed integers and fp16 scales near `scale`."""
    if k % GROUP or n % PER_WORD:
        raise ValueError(f"a GPTQ layer needs K a multiple of {GROUP} and N of {PER_WORD}, got [{n}, {k}]")
    return {"qweight": torch.randint(-(2**31), 2**31 - 1, (k // PER_WORD, n), generator=gen, dtype=torch.int32),
            "qzeros": torch.full((k // GROUP, n // PER_WORD), SYM_ZEROS_V1, dtype=torch.int32),
            "scales": (scale * (0.5 + torch.rand(k // GROUP, n, generator=gen))).to(torch.float16),
            "g_idx": (torch.arange(k, dtype=torch.int32) // GROUP)}


def layer_tensors(cfg: dict, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every tensor of decoder layer `i`, by checkpoint key."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    scale = 0.02 / 4.6  # weights (q - 8) * s of about N(0, 0.02): q - 8 is uniform on -8..7, std 4.6
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    out = {}
    for module, (n, k) in shapes.items():
        for part, t in gptq_layer(n, k, gen, scale).items():
            out[f"model.layers.{i}.{module}.{part}"] = t
    if cfg["model_type"] == "qwen2":
        for p, n in (("q", h), ("k", kv), ("v", kv)):
            out[f"model.layers.{i}.self_attn.{p}_proj.bias"] = (0.02 * torch.randn(n, generator=gen)).half()
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{i}.{norm}.weight"] = torch.ones(h, dtype=torch.float16)
    return out


def write_checkpoint(out: str, shape: str, shard_gb: float = 5.0, seed: int = 0) -> dict:
    """Write the checkpoint of `shape` (SHAPES) into folder `out`; returns {"files", "bytes", "seconds"}. Raises
    ValueError for an unknown shape."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    start = time.perf_counter()
    cfg = {**SHAPES[shape], "torch_dtype": "float16", "quantization_config": QUANTIZATION_CONFIG}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    weight_map: dict[str, str] = {}
    files: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        nonlocal shard, total
        if not shard:
            return
        name = f"model-{len(files) + 1:05d}.safetensors"  # renamed to -of-N once N is known
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        files.append((name, list(shard)))
        shard = {}

    def add(tensors: dict[str, torch.Tensor]) -> None:
        shard.update(tensors)
        if sum(t.numel() * t.element_size() for t in shard.values()) >= shard_gb * 1e9:
            flush()

    add({"model.embed_tokens.weight": (0.02 * torch.randn(vocab, h, generator=gen)).half()})
    for i in range(cfg["num_hidden_layers"]):
        add(layer_tensors(cfg, i, gen))
    add({"model.norm.weight": torch.ones(h, dtype=torch.float16),
         "lm_head.weight": (0.02 * torch.randn(vocab, h, generator=gen)).half()})
    flush()
    for k, (name, keys) in enumerate(files):
        final = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(folder / name, folder / final)
        weight_map.update(dict.fromkeys(keys, final))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg["bos_token_id"],
                                                               "eos_token_id": cfg["eos_token_id"]}))
    from engine.loading.model_files import default_model_path
    from engine.text.tokenizer import Tokenizer

    Tokenizer.from_gguf(default_model_path()).hf_tokenizer.save_pretrained(str(folder))
    return {"files": len(files), "bytes": total, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write (created)")
    ap.add_argument("--shape", default="llama-3.1-70b", choices=list(SHAPES))
    ap.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    done = write_checkpoint(args.out, args.shape, args.shard_gb, args.seed)
    print(json.dumps({"event": "big_checkpoint", "shape": args.shape, "out": args.out, **done}))


if __name__ == "__main__":
    main()
