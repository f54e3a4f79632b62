"""Quantized mixture-of-experts experts (engine.layers.moe.GroupedExperts): the projections' stacked INT4 weights
(engine.quant.stacked_int4.StackedInt4: qweight uint8 [E, N, Kp/2], scales and zeros [E, N, Kp/G], in_perm None or
[E, K]) served on CUDA by the grouped W4A16 kernel alone (GroupedExperts.set_int4), elsewhere each expert's fused
gate/up and its down projection by the dense layers' INT4 module (engine.quant.int4_linear.Int4Linear) over its slice
of the stacked weight, handed to GroupedExperts.set_gemms one module per expert. The router (mlp.gate) and a shared
expert's gate stay in the compute dtype, as in vLLM; a shared expert is a dense MLP and is quantized as one.

The stacked weights come from every path the dense layers' INT4 weights come from: quantized on load
(engine.quant.handler.Int4QuantHandler, round-to-nearest with the MSE scale fit, one expert at a time), a GGUF file's
Q4_0 / Q4_1 / Q4_K expert tensors mapped exactly (engine.loading.gguf_int4), a GPTQ / AWQ / compressed-tensors
folder's per-expert layers as stored (engine.loading.hf_quantized) or a tokenmill INT4 folder.

Kernels per device (`grouped_int4_experts` decides CUDA's):
    CUDA, Triton  the stacked weights on the device, scales and zeros as loaded, and no per-expert module: the grouped
                  W4A16 kernel (engine.kernels.triton_moe_int4.fused_experts_int4) runs both projections, biases and
                  gpt-oss's clamped SwiGLU included, CUDA-graph capturable. One copy whatever the INT4 layout
                  (engine.worker.memory_fit counts it so: grouped_int4_experts_expected).
    CUDA, else    (Triton missing, TOKENMILL_TRITON_MOE=0, or a projection that is not INT4) the per-expert loop runs
                  each expert's Int4Linear without GemLite (per-expert GemLite modules would tune and compile for
                  every expert): layout "dual" packs tinygemm per expert for small row counts beside the
                  dequantize-then-GEMM path over views of the stacked weights (two copies, as memory_fit counts
                  "dual"); layout "single" keeps the stacked weights only and dequantizes (one copy).
    CPU, bf16     torch's `_weight_int4pack_mm_for_cpu`, each expert packed once (its own copy; the stacked portable
                  weights are dropped by int4_linear.release_int4_sources, as the dense layers' sources are);
    CPU, fp32     dequantize-then-GEMM in fp32 (exact weights), reading views of the stacked tensors (no copy).
A projection that is not INT4 (a GGUF file's Q6_K down under quantization "auto") runs per expert as an nn.Linear over
its slice of the stacked weight in the compute dtype (oneDNN-packed on the CPU later, as every plain linear is).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kernels.triton_moe import DTYPES as TRITON_MOE_DTYPES
from engine.kernels.triton_moe_int4 import triton_moe_int4_ops
from engine.layers.moe import GroupedExperts
from engine.quant.int4_kernel_plan import CUDA_DEQUANT_MIN_ROWS
from engine.quant.int4_linear import Int4Linear
from engine.quant.int8_linear import Int8Linear
from engine.quant.qparams import quantize_int4
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
    """Serve each expert block of `blocks` (pop_int4_experts), gate and up fused (their stacked INT4 weights joined
    along N, rows [gate; up] per expert), biases in `dtype`: on the grouped INT4 kernel alone where it serves
    (grouped_int4_experts: GroupedExperts.set_int4, the stacked weights on `device`, no per-expert module), else
    with one module per expert (module docstring; GroupedExperts.set_gemms, the stacked INT4 weights kept on
    `device` beside them as its `int4`). Gate and up that cannot be joined as INT4 (one of them plain, or different
    groups or input orders) are dequantized exactly instead (logged). Raises ValueError as Int4Linear."""
    for owner, (parts, biases) in blocks.items():
        experts = model.get_submodule(owner)
        gate_up = _fuse(parts["gate_proj"], parts["up_proj"], dtype, owner)
        down = parts["down_proj"]
        gate_up, down = (w.to(device) if isinstance(w, StackedInt4) else w.to(device, dtype) for w in (gate_up, down))
        bias = None
        if biases:
            bias = (torch.cat([biases["gate_proj"], biases["up_proj"]], dim=1).to(device, dtype),
                    biases["down_proj"].to(device, dtype))
        if grouped_int4_experts(gate_up, down, dtype, device):
            experts.set_int4(gate_up, down, biases=bias)
            continue
        experts.set_gemms(expert_modules(gate_up, dtype, device, layout), expert_modules(down, dtype, device, layout),
                          biases=bias, int4=tuple(w if isinstance(w, StackedInt4) else None for w in (gate_up, down)))


def grouped_int4_experts(gate_up: StackedInt4 | torch.Tensor, down: StackedInt4 | torch.Tensor, dtype: torch.dtype,
                         device: torch.device) -> bool:
    """Whether an expert block of these stacked projections runs on the grouped INT4 kernel alone (no per-expert
    modules): both StackedInt4, a CUDA device, an activation dtype the kernel takes (fp32/fp16/bf16) and the kernel
    available (engine.kernels.triton_moe_int4.triton_moe_int4_ops: Triton installed, TOKENMILL_TRITON_MOE not 0)."""
    return (device.type == "cuda" and isinstance(gate_up, StackedInt4) and isinstance(down, StackedInt4)
            and dtype in TRITON_MOE_DTYPES and triton_moe_int4_ops() is not None)


def quantize_experts(model: nn.Module, group_size: int = 128, layout: str = "dual") -> int:
    """Quantize the experts of every plain expert block of a filled model (its stacked weights, fused or not) to INT4
    by round-to-nearest with the MSE scale fit, bf16 scales (qparams.quantize_int4: the numbers
    engine.quant.handler.Int4QuantHandler gives a loaded model's, expert by expert; here a chunk of experts per call,
    the groups running along K), and serve them as set_int4_experts does, on the weights' device with their dtype
    (biases kept, router untouched). Returns the number of blocks quantized."""
    blocks = [(name, m) for name, m in model.named_modules()
              if isinstance(m, GroupedExperts) and m.gemms is None and m.int4 is None]
    for name, experts in blocks:
        gate_up, down = (w.detach() for w in experts.stacked())
        gate, up = gate_up.split(experts.intermediate_size, dim=1)
        parts: ExpertParts = {p: _quantize_stack(t, group_size)
                              for p, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))}
        biases = {}
        if experts.gate_up_proj.bias is not None:
            gate_b, up_b = experts.gate_up_proj.bias.detach().split(experts.intermediate_size, dim=1)
            biases = {"gate_proj": gate_b, "up_proj": up_b, "down_proj": experts.down_proj.bias.detach()}
        set_int4_experts(model, {name: (parts, biases)}, down.dtype, down.device, layout)
    return len(blocks)


def _quantize_stack(w: torch.Tensor, group_size: int) -> StackedInt4:
    """w [E, N, K] as quantize_int4 quantizes each expert's [N, K], a chunk of experts ([e * N, K], about 2^27
    weights) per call: the same numbers in fewer launches."""
    e, n, k = w.shape
    chunk = max(1, (1 << 27) // (n * k))
    parts = [quantize_int4(w[i:i + chunk].reshape(-1, k), group_size) for i in range(0, e, chunk)]
    return StackedInt4(*(torch.cat([getattr(q, f) for q in parts]).view(e, n, -1) for f in ("qweight", "scales",
                                                                                             "zeros")), k, group_size)


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
        if m.gemms is None and m.int4 is not None:  # set_int4: the grouped kernel's stacks alone
            held = (f"gate/up INT4 (group {m.int4[0].group_size}), down INT4 (group {m.int4[1].group_size}) on the "
                    "grouped kernel")
        elif m.gemms is None:  # the stacked weights, plain
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
