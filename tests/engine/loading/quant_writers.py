"""Writers of quantized Hugging Face folders for the loader tests: a tiny fp32 HF model's projections quantized
round-to-nearest to known integers, packed as each format's producer packs them, with the exact reference weights
W = (q - z) * s computed here in fp32 from those integers (the bit-for-bit reference).

Packings followed (read with the search/fetch tools; the producers do not install on torch 2.13 CPU except
compressed-tensors, whose own pack_to_int32 packs here):
    GPTQ (AutoGPTQ / GPTQModel QuantLinear.pack): qweight int32 [K / (32/b), N], element k of column n at bits
        (k % (32/b)) * b of word k // (32/b); qzeros int32 [G, N / (32/b)] along the outputs, v1 storing z - 1;
        scales fp16 [G, N]; g_idx int32 [K].
    AWQ GEMM (AutoAWQ WQLinear_GEMM.from_linear): qweight int32 [K, N / 8], qzeros int32 [G, N / 8], nibble i of a
        word = output column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales fp16 [G, N].
    compressed-tensors pack-quantized / int-quantized / float-quantized (its compressors, via its own helpers).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, scale_dtype: torch.dtype = torch.float16,
        g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of w [N, K]: (q int64 [N, K] in 0..2^b-1, z int64 [N, G], s [N, G] in scale_dtype,
    g_idx int64 [K]); group <= 0 = per channel; g_idx = the group of each feature (default k // group)."""
    n, k = w.shape
    size = k if group <= 0 else group
    g_idx = torch.arange(k) // size if g_idx is None else g_idx
    n_groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    s, z = torch.empty(n, n_groups), torch.empty(n, n_groups, dtype=torch.int64)
    for g in range(n_groups):
        cols = w[:, g_idx == g]
        if sym:
            s[:, g] = cols.abs().amax(1) / ((top - 1) / 2)
            z[:, g] = 1 << (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s[:, g] = (hi - lo) / top
            z[:, g] = (-lo / s[:, g].to(scale_dtype).float()).round().clamp(0, top).long()
    s = s.to(scale_dtype)
    q = (w / s.float()[:, g_idx] + z[:, g_idx]).round().clamp(0, top).long()
    return q, z, s, g_idx


def dequant(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The reference weight fp32 [N, K] = (q - z) * s, from the integers (no rounding for fp16/bf16 scales)."""
    return (q - z[:, g_idx]).float() * s.float()[:, g_idx]


def pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C * 32/b] -> int32 [R, C]: element j of word c at bits (j % (32/b)) * b."""
    per = 32 // bits
    v = v.long().reshape(v.shape[0], -1, per)
    words = sum(v[..., j] << (j * bits) for j in range(per))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptq_tensors(q, z, s, g_idx, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    zeros = ((z - 1) & ((1 << bits) - 1)) if v1 else z
    n, k = q.shape
    per = 32 // bits
    along_k = q.t().reshape(k // per, per, n).permute(0, 2, 1).reshape(k // per, n * per)  # word [w, n]: k = w*per + j
    return {"qweight": pack_rows(along_k, bits),
            "qzeros": pack_rows(zeros.t().contiguous(), bits), "scales": s.t().contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def awq_tensors(q, z, s) -> dict[str, torch.Tensor]:
    def pack(v: torch.Tensor) -> torch.Tensor:  # [R, N] in column order -> int32 [R, N / 8] in AWQ's order
        v = v.reshape(v.shape[0], -1, 8)[..., list(AWQ_ORDER)]
        return pack_rows(v.reshape(v.shape[0], -1), 4)
    return {"qweight": pack(q.t().contiguous()), "qzeros": pack(z.t().contiguous()), "scales": s.t().contiguous()}


def write_quantized(folder: Path, model, hf_tok, method: str, quant_config: dict, layer_fn) -> dict[str, torch.Tensor]:
    """Save `model` (an HF fp32 model) as a quantized folder: each projection's tensors from
    layer_fn(weight fp32 [N, K]) -> ({suffix: tensor}, reference fp32 [N, K]). Returns {checkpoint module name:
    reference weight}; writes config.json with quantization_config = quant_config and the tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = dict(quant_config, quant_method=method)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    hf_tok.save_pretrained(folder)
    tensors, refs = {}, {}
    for name, t in model.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            parts, refs[module] = layer_fn(t.detach().float())
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        elif not (model.config.tie_word_embeddings and name == "lm_head.weight"):
            tensors[name] = t.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return refs


def ct_int_tensors(q, z, s, bits: int, packed: bool, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized (packed) or int-quantized tensors of unsigned q, z (signed: minus 2^(b-1))."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    off = 1 << (bits - 1)
    signed = (q - off).to(torch.int8)
    out = {"weight_scale": s}
    if packed:
        out.update(weight_packed=pack_to_int32(signed, bits), weight_shape=torch.tensor(list(q.shape)))
        if not sym:
            out["weight_zero_point"] = pack_to_int32((z - off).to(torch.int8), bits, packed_dim=0)
    else:
        out["weight"] = signed
        if not sym:
            out["weight_zero_point"] = (z - off).to(torch.int8)
    return out


def ct_config(fmt: str, weights: dict, activations: dict | None = None) -> dict:
    """A compressed-tensors quantization_config with one group over every Linear but the LM head."""
    return {"format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(weights, dynamic=False),
                                          "input_activations": activations, "output_activations": None}}}
