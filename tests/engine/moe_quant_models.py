"""Helpers of the quantized mixture-of-experts tests (tests/engine/model/test_moe_quantized.py,
tests/engine/loading/test_hf_quantized_moe.py): the weights a loaded model's kernels hold, as fp32 tensors under our
unfused parameter names (the reference HF model is given exactly those: tests/engine/moe_models.hf_holding); HF run
with activations rounded per token as the W8A8 kernel rounds them; and a quantized HF MoE folder written from a
tiny model's per-expert checkpoint, beside the same folder holding the reference (dequantized) weights that HF
transformers loads itself.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

#: The linear modules a quantized MoE checkpoint quantizes: attention, experts (Mixtral's w1/w2/w3 too) and a shared
#: expert; the router (mlp.gate, block_sparse_moe.gate) and shared_expert_gate stay as they are (as vLLM and the
#: published GPTQ/AWQ checkpoints keep them).
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def loaded_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{our parameter name: fp32 weight} of a model as loaded (before LLMEngine releases its INT4 sources and packs
    it): Int4Linear / Int8Linear weights dequantized from what they hold, every expert's module stacked back into
    [E, out, in] (gate/up split; the grouped INT4 kernel's stacks dequantized), fused Q/K/V and gate/up (INT8 loads
    fuse first) split into their parts, plain parameters as they are."""
    from engine.layers.moe import GroupedExperts
    from engine.model.tensor_names import split_fused
    from engine.quant.int4_linear import Int4Linear
    from engine.quant.int8_linear import Int8Linear

    def weight(m: nn.Module) -> torch.Tensor:
        m = getattr(m, "inner", m)
        return m.source.dequantize() if isinstance(m, Int4Linear | Int8Linear) else m.weight.detach().float()

    out = {n: p.detach().float() for n, p in model.named_parameters() if ".packed_" not in n}
    for name, m in model.named_modules():
        if ".packed_" not in name and not name.endswith(".inner") and isinstance(
                getattr(m, "inner", m), Int4Linear | Int8Linear):
            out[f"{name}.weight"] = weight(m)
        elif isinstance(m, GroupedExperts) and (m.gemms is not None or m.int4 is not None):
            if m.gemms is not None:
                gate_up = torch.stack([weight(g) for g in m.gemms[0]])
                down = torch.stack([weight(d) for d in m.gemms[1]])
            else:  # the grouped INT4 kernel's stacks alone (GroupedExperts.set_int4)
                gate_up, down = (w.dequantize() for w in m.int4)
            out[f"{name}.gate_proj.weight"], out[f"{name}.up_proj.weight"] = gate_up.split(m.intermediate_size, 1)
            out[f"{name}.down_proj.weight"] = down
    for key in [k for k in out if ".gate_up_proj." in k and ".experts." not in k]:  # a fused MLP / shared expert
        stem, _, suffix = key.partition(".gate_up_proj.")
        out[f"{stem}.gate_proj.{suffix}"], out[f"{stem}.up_proj.{suffix}"] = out.pop(key).chunk(2)
    cfg = model.config
    for key in [k for k in out if ".qkv_proj." in k]:
        out.update(split_fused(key, out.pop(key), cfg))
    return out


@contextlib.contextmanager
def w8a8_activations(keep: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, every torch.nn.functional.linear whose weight is not one of `keep` (by identity: the LM
    head, routers, shared-expert gates) multiplies its input rounded per token as the W8A8 kernel rounds it
    (engine.quant.int8_linear.quantize_activations_int8: scale max|x| / 127, x -> round(x / scale) * scale)."""
    functional = torch.nn.functional
    original, kept = functional.linear, {id(t) for t in keep}

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if id(weight) not in kept:
            rows = x.reshape(-1, x.shape[-1]).float()
            scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
            x = (torch.round(rows / scale) * scale).reshape(x.shape).to(x.dtype)
        return original(x, weight, bias)

    functional.linear = linear
    try:
        yield
    finally:
        functional.linear = original


def write_quantized_moe(src: Path, dst: Path, reference: Path, method: str, quant_config: dict,
                        layer_fn: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]) -> None:
    """The HF folder `src` (per-expert checkpoint) as a quantized folder `dst`: each QUANTIZED module's tensors from
    layer_fn(checkpoint module name, weight fp32 [N, K]) -> ({suffix: tensor}, reference fp32 [N, K]), every other
    tensor as it is, config.json with quantization_config = quant_config (quant_method `method`); and `reference`,
    the same folder holding the reference weights unquantized (what HF transformers loads as the reference)."""
    from safetensors.torch import load_file, save_file

    for folder in (dst, reference):
        shutil.copytree(src, folder)
    quantized, plain = {}, {}
    for key, t in load_file(str(src / "model.safetensors")).items():
        module = key.removesuffix(".weight")
        if key.endswith(".weight") and module.rsplit(".", 1)[-1] in QUANTIZED:
            parts, plain[key] = layer_fn(module, t.float())
            quantized.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        else:
            quantized[key] = plain[key] = t
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in plain.items()}, str(reference / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = dict(quant_config, quant_method=method)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
