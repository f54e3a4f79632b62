"""Tiny random-weight gpt-oss models built by HF transformers from GptOssConfig (fp32, eager attention), saved as HF
folders beside the real SmolLM2 tokenizer, with their experts as dense tensors or as MXFP4 blocks and scales in
OpenAI's published layout, and written as GGUF in the layout llama.cpp's convert_hf_to_gguf.py (GptOssModel) writes
from such a folder. Used by tests/engine/model/test_gpt_oss.py and test_gpt_oss_gguf.py.

The converter's layout (read in llama.cpp, not copied): architecture "gpt-oss"; the common keys plus
`expert_feed_forward_length`, `attention.sliding_window` and YaRN's `rope.scaling.*` (type, factor, original
context, beta_fast, beta_slow); HF names through gguf's tensor map, the router as `ffn_gate_inp`, the sinks as
`attn_sinks.weight`; each layer's `gate_up_proj` [E, hidden, 2I] transposed to [E, 2I, hidden] and its interleaved
rows taken apart (gate = even rows, up = odd) into `ffn_gate_exps` / `ffn_up_exps`, biases alike, `down_proj`
transposed into `ffn_down_exps`; MXFP4 blocks and scales repacked (rows split the same way, no transpose: they are
[E, out, in] already) into ggml's MXFP4 type, every other tensor in the output type (F32 here).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from family_models import finish_gguf

FP4_GRID = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
WINDOW = 16  # tokens: the sliding layers' window, shorter than every chat-templated prompt


def gpt_oss_config(vocab: int, swiglu_limit: float):
    """2 layers (the first sliding with a window of WINDOW tokens, the second full), 4 query / 2 KV heads of 16, YaRN
    past an original context of 64 with truncate false (as gpt-oss's own configs), 8 experts of which 2 per token."""
    import transformers

    return transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=2048, swiglu_limit=swiglu_limit, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        attn_implementation="eager")


def build_gpt_oss(vocab: int, swiglu_limit: float, seed: int, gate_up_scale: float = 1.0):
    """The fp32 eager HF model: weights at a scale that gives varied greedy text and routing, biases, sinks and norms
    random too (llama_family_models.randomize), the experts' gate_up_proj times `gate_up_scale` (so that the clamp at
    `swiglu_limit` bites)."""
    import transformers
    from llama_family_models import randomize

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(gpt_oss_config(vocab, swiglu_limit),
                                                          dtype=torch.float32).eval()
    randomize(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(gate_up_scale)
    return model


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of w [..., K] (K % 32 == 0) as OCP MX v1.0 defines it: per 32 values the E8M0 scale 2 ** (floor(log2
    amax) - 2), each value / scale rounded to the nearest FP4 E2M1 value (clamped to +-6). Returns (blocks uint8
    [..., K / 32, 16], two codes a byte, the earlier one in the low nibble; scales uint8 [..., K / 32], biased by
    127)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -126))) - 2
    scaled = groups / torch.exp2(exp)[..., None]
    idx = (scaled.abs()[..., None] - FP4_GRID).abs().argmin(-1)
    codes = (idx | (((scaled < 0) & (idx > 0)).long() << 3)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def write_mxfp4_folder(src: Path, dst: Path) -> None:
    """A copy of the HF folder `src` whose expert weights are MXFP4 blocks and scales, as OpenAI's checkpoints store
    them: `<proj>_blocks` [E, out, in / 32, 16] of the weight transposed back to [E, out, in]."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    out = {}
    for key, t in load_file(src / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{key}_blocks"], out[f"{key}_scales"] = quantize_mxfp4(t.transpose(1, 2).contiguous())
        else:
            out[key] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def to_ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """OpenAI's MXFP4 (blocks uint8 [..., G, 16], value 2j in byte j's low nibble and 2j + 1 in its high one; scales
    uint8 [..., G]) as ggml's MXFP4 data uint8 [..., G * 17]: per group the scale byte, then 16 bytes whose low
    nibbles hold values 0..15 and high nibbles values 16..31 (what the converter's repack_mxfp4 writes)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scales[..., None], packed), dim=-1)
    return out.reshape(*blocks.shape[:-2], -1).numpy()


def _gguf_tensors(folder: Path, num_layers: int) -> dict[str, tuple[np.ndarray, object]]:
    """{GGUF name: (array, ggml type)} of an HF gpt-oss folder, as the converter names and lays them out."""
    import gguf
    from safetensors.torch import load_file

    f32, mxfp4 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.MXFP4
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, num_layers)
    stored = load_file(folder / "model.safetensors")
    out: dict[str, tuple[np.ndarray, object]] = {}
    for key, t in stored.items():
        layer, _, tail = key.removeprefix("model.layers.").partition(".mlp.experts.")
        if not tail:  # not an expert tensor: HF names through the map; the sinks get the converter's ".weight"
            name = key + ".weight" if key.endswith("sinks") else key
            out[tmap.get_name(name, try_suffixes=(".weight", ".bias"))] = (t.float().numpy(), f32)
            continue
        if tail.endswith("_scales"):  # read with its blocks
            continue
        proj = tail.removesuffix("_bias").removesuffix("_blocks")
        kind = "bias" if tail.endswith("_bias") else "weight"
        if tail.endswith("_blocks"):  # [E, out, in / 32, 16] and [E, out, in / 32]: rows already [E, out, ...]
            value, scales = t, stored[key.removesuffix("_blocks") + "_scales"]
        else:  # a dense weight is stored [E, in, out]
            value, scales = (t if kind == "bias" else t.transpose(1, 2)), None
        parts = {"down": slice(None)} if proj == "down_proj" else {"gate": slice(0, None, 2), "up": slice(1, None, 2)}
        for part, rows in parts.items():
            name = f"blk.{layer}.ffn_{part}_exps.{kind}"
            if scales is None:
                out[name] = (value[:, rows].float().contiguous().numpy(), f32)
            else:
                out[name] = (to_ggml_mxfp4(value[:, rows].contiguous(), scales[:, rows].contiguous()), mxfp4)
    return out


def write_gpt_oss_gguf(path: Path, folder: Path, tok_fields: list, chat_template: str | None = None,
                       metadata: dict[str, object] | None = None, tensors: dict[str, np.ndarray] | None = None,
                       drop: tuple[str, ...] = ()) -> None:
    """The HF gpt-oss `folder` (dense or MXFP4 experts) as llama.cpp's converter writes it (module docstring), with
    the tokenizer fields `tok_fields` ((key, value, type, sub_type); `chat_template` replaces tokenizer.chat_template),
    `metadata` ({key without "gpt-oss.": value}, written after the converter's), `tensors` added and the tensors
    named in `drop` left out: the variants the refusal tests need."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for add, value in (  # TextModel.set_gguf_parameters, then GptOssModel's window and expert width
            (w.add_block_count, cfg["num_hidden_layers"]), (w.add_context_length, cfg["max_position_embeddings"]),
            (w.add_embedding_length, cfg["hidden_size"]), (w.add_feed_forward_length, cfg["intermediate_size"]),
            (w.add_head_count, cfg["num_attention_heads"]), (w.add_head_count_kv, cfg["num_key_value_heads"]),
            (w.add_rope_scaling_type, gguf.RopeScalingType.YARN), (w.add_rope_scaling_factor, rope["factor"]),
            (w.add_rope_scaling_orig_ctx_len, rope["original_max_position_embeddings"]),
            (w.add_rope_scaling_yarn_beta_fast, rope["beta_fast"]),
            (w.add_rope_scaling_yarn_beta_slow, rope["beta_slow"]),
            (w.add_rope_freq_base, rope.get("rope_theta", cfg.get("rope_theta"))),
            (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]), (w.add_expert_count, cfg["num_local_experts"]),
            (w.add_expert_used_count, cfg["num_experts_per_tok"]), (w.add_key_length, cfg["head_dim"]),
            (w.add_value_length, cfg["head_dim"]), (w.add_sliding_window, cfg["sliding_window"]),
            (w.add_expert_feed_forward_length, cfg["intermediate_size"])):
        add(value)
    for key, value in (metadata or {}).items():
        vtype = gguf.GGUFValueType.get_type(value)
        w.add_key_value(f"gpt-oss.{key}", value, vtype,
                        sub_type=gguf.GGUFValueType.get_type(value[0]) if isinstance(value, list) else None)
    for name, value, vtype, sub in tok_fields:
        if name == "tokenizer.chat_template" and chat_template is not None:
            value = chat_template
        w.add_key_value(name, value, vtype, sub_type=sub)
    written = _gguf_tensors(folder, cfg["num_hidden_layers"])
    written.update({name: (a, gguf.GGMLQuantizationType.F32) for name, a in (tensors or {}).items()})
    finish_gguf(w, {name: v for name, v in written.items() if name not in drop})
