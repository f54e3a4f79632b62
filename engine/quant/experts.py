"""Quantized mixture-of-experts experts (engine.layers.moe.GroupedExperts): each expert's fused gate/up and its down
projection served by the dense layers' INT4 module (engine.quant.int4_linear.Int4Linear) over its slice of the
projection's stacked INT4 weight (engine.quant.stacked_int4.StackedInt4: qweight uint8 [E, N, Kp/2], scales and zeros
[E, N, Kp/G], in_perm None or [E, K]), handed to GroupedExperts.set_gemms one module per expert. The router
(mlp.gate) and a shared expert's gate stay in the compute dtype, as in vLLM; a shared expert is a dense MLP and is
quantized as one.

The stacked weights come from every path the dense layers' INT4 weights come from: quantized on load
(engine.quant.handler.Int4QuantHandler, round-to-nearest with the MSE scale fit, one expert at a time), a GGUF file's
Q4_0 / Q4_1 / Q4_K expert tensors mapped exactly (engine.loading.gguf_int4), a GPTQ / AWQ / compressed-tensors
folder's per-expert layers as stored (engine.loading.hf_quantized) or a tokenmill INT4 folder.

Kernels per device (what each expert's Int4Linear builds):
    CPU, bf16     torch's `_weight_int4pack_mm_for_cpu`, each expert packed once (its own copy; the stacked portable
                  weights are dropped by int4_linear.release_int4_sources, as the dense layers' sources are);
    CPU, fp32     dequantize-then-GEMM in fp32 (exact weights), reading views of the stacked tensors (no copy);
    CUDA          the stacked weights stay on the device: the operand of the grouped W4A16 kernel
                  (engine.kernels.triton_moe_int4.fused_experts_int4 takes GroupedExperts.int4_experts() as they
                  are). Until it is wired into GroupedExperts.forward, the per-expert loop runs each expert's
                  Int4Linear without GemLite (per-expert GemLite modules would tune and compile for every expert):
                  layout "dual" packs tinygemm per expert for small row counts beside the dequantize-then-GEMM path
                  over views of the stacked weights (two copies, as engine.worker.memory_fit counts "dual"); layout
                  "single" keeps the stacked weights only and dequantizes (one copy).
A projection that is not INT4 (a GGUF file's Q6_K down under quantization "auto") runs per expert as an nn.Linear over
its slice of the stacked weight in the compute dtype (oneDNN-packed on the CPU later, as every plain linear is).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.layers.moe import GroupedExperts
from engine.quant.int4_linear import CUDA_DEQUANT_MIN_ROWS, Int4Linear
from engine.quant.int8_linear import Int8Linear
from engine.quant.stacked_int4 import StackedInt4

log = logging.getLogger(__name__)

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ExpertParts = dict[str, "StackedInt4 | torch.Tensor"]


def pop_int4_experts(model: nn.Module, state: dict) -> dict[str, tuple[ExpertParts, dict[str, torch.Tensor]]]:
    """Take, out of `state` (a quantized state dict, engine.quant.state), every expert block that holds a StackedInt4:
    {GroupedExperts module name: ({projection: StackedInt4 or plain tensor [E, out, in]},
    {projection: bias [E, out]})}, and drop those blocks' stacked parameters from the meta-device `model`, so that
    engine.model.fill.fill_model neither fills nor asks for them. Raises ValueError when an INT4 weight does not fit
    its expert block's shape or a projection is missing."""
    owners = {name.rpartition(".")[0] for name, w in state.items() if isinstance(w, StackedInt4)}
    out = {}
    for owner in sorted(owners):
        experts = model.get_submodule(owner)
        if not isinstance(experts, GroupedExperts):
            raise ValueError(f"stacked INT4 weights under {owner}, which is no mixture-of-experts block of the model")
        parts, biases = {}, {}
        for proj in _PROJECTIONS:
            slot = getattr(experts, proj)
            w = state.pop(f"{owner}.{proj}", None)
            w = state.pop(f"{owner}.{proj}.weight", None) if w is None else w
            if w is None:
                raise ValueError(f"the model file lacks {owner}.{proj}")
            have = (w.num_experts, w.out_features, w.in_features) if isinstance(w, StackedInt4) else tuple(w.shape)
            if have != tuple(slot.weight.shape):
                raise ValueError(f"expert weight {owner}.{proj} is {list(have)}, the model wants "
                                 f"{list(slot.weight.shape)}: the model file does not match its config")
            parts[proj] = w
            if slot.bias is not None:
                biases[proj] = state.pop(f"{owner}.{proj}.bias")
            setattr(experts, proj, None)
        out[owner] = (parts, biases)
    return out


def set_int4_experts(model: nn.Module, blocks: dict[str, tuple[ExpertParts, dict[str, torch.Tensor]]],
                     dtype: torch.dtype, device: torch.device, layout: str = "dual") -> None:
    """Serve each expert block of `blocks` (pop_int4_experts) with one module per expert (module docstring): gate
    and up fused (their stacked INT4 weights joined along N, rows [gate; up] per expert), the stacked INT4 weights
    on `device` and kept for grouped kernels (GroupedExperts.set_gemms' `int4`), biases in `dtype`. Gate and up that
    cannot be joined as INT4 (one of them plain, or different groups or input orders) are dequantized exactly
    instead (logged). Raises ValueError as Int4Linear."""
    for owner, (parts, biases) in blocks.items():
        experts = model.get_submodule(owner)
        gate_up = _fuse(parts["gate_proj"], parts["up_proj"], dtype, owner)
        down = parts["down_proj"]
        gate_up, down = (w.to(device) if isinstance(w, StackedInt4) else w.to(device, dtype) for w in (gate_up, down))
        bias = None
        if biases:
            bias = (torch.cat([biases["gate_proj"], biases["up_proj"]], dim=1).to(device, dtype),
                    biases["down_proj"].to(device, dtype))
        experts.set_gemms(expert_modules(gate_up, dtype, device, layout), expert_modules(down, dtype, device, layout),
                          biases=bias, int4=tuple(w if isinstance(w, StackedInt4) else None for w in (gate_up, down)))


def _fuse(gate: StackedInt4 | torch.Tensor, up: StackedInt4 | torch.Tensor, dtype: torch.dtype,
          owner: str) -> StackedInt4 | torch.Tensor:
    """gate [E, I, K] and up [E, I, K] as one stacked [E, 2I, K]: INT4 when both are INT4 alike, else plain."""
    if isinstance(gate, StackedInt4) and isinstance(up, StackedInt4) and (
            (gate.group_size, gate.scales.dtype) == (up.group_size, up.scales.dtype)
            and (gate.in_perm is None) == (up.in_perm is None)
            and (gate.in_perm is None or torch.equal(gate.in_perm, up.in_perm))):
        return StackedInt4(*(torch.cat([getattr(gate, p), getattr(up, p)], dim=1)
                             for p in ("qweight", "scales", "zeros")), gate.in_features, gate.group_size, gate.in_perm)
    if isinstance(gate, StackedInt4) or isinstance(up, StackedInt4):
        log.info("%s: gate and up experts stored in different forms (INT4 with another group or input order, or "
                 "one of them not INT4); running both dequantized (exact) in %s", owner, dtype)
    return torch.cat([w.dequantize(dtype) if isinstance(w, StackedInt4) else w.to(dtype) for w in (gate, up)], dim=1)


def expert_modules(weight: StackedInt4 | torch.Tensor, dtype: torch.dtype, device: torch.device,
                   layout: str = "dual") -> list[nn.Module]:
    """One module per expert of a stacked projection on `device`: an Int4Linear over expert e's slice of a
    StackedInt4 (module docstring: its kernels per device and `layout`), or an nn.Linear whose weight is expert e's
    slice of a plain stacked tensor [E, out, in] in `dtype` (a view: no copy)."""
    if isinstance(weight, StackedInt4):
        if device.type == "cuda":  # no GemLite; dual: tinygemm + dequantize over the stacked views, single: dequantize
            rows: int | None = CUDA_DEQUANT_MIN_ROWS if layout == "dual" else 0
            return [Int4Linear(weight.expert(e), dtype, device, rows, gemlite=False, layout=layout)
                    for e in range(weight.num_experts)]
        return [Int4Linear(weight.expert(e), dtype, device, layout=layout) for e in range(weight.num_experts)]
    mods = []
    for w in weight:
        m = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        m.weight = nn.Parameter(w, requires_grad=False)
        mods.append(m)
    return mods


def describe_experts(model: nn.Module) -> str | None:
    """How a mixture-of-experts model's experts are held, one line for the load log, e.g. "experts gate/up INT4
    (group 32), down INT4 (group 32) in 48 of 48 layers; router float32"; None for a model without experts."""
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    if not blocks:
        return None
    seen: dict[str, int] = {}
    for _, m in blocks:
        if m.gemms is None:  # the stacked weights, plain
            held = f"gate/up and down {str(m.down_proj.weight.dtype).removeprefix('torch.')}"
        else:
            held = f"gate/up {_held(m.gemms[0][0])}, down {_held(m.gemms[1][0])}"
        seen[held] = seen.get(held, 0) + 1
    router = model.get_submodule(blocks[0][0].rpartition(".")[0]).gate
    dtype = getattr(router, "dtype", None) or getattr(router, "weight", torch.empty(0)).dtype
    return "; ".join(f"experts {held} in {n} of {len(blocks)} layers" for held, n in seen.items()) + (
        f"; router {str(dtype).removeprefix('torch.')}")


def _held(module: nn.Module) -> str:
    """How one expert module holds its weight: "INT4 (group G)", "INT8 (W8A8)" or its dtype."""
    module = getattr(module, "inner", module)
    if isinstance(module, Int4Linear):
        return f"INT4 (group {module.group_size})"
    if isinstance(module, Int8Linear):
        return "INT8 (W8A8)"
    dtype = getattr(module, "dtype", None) or module.weight.dtype
    return str(dtype).removeprefix("torch.")
