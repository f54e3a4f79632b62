"""The sparse mixture-of-experts MLP block: a router picks each token's top-k experts (SwiGLU MLPs), and the token's
output is the weighted sum of theirs (Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer", 2017; Fedus et al., Switch Transformer, 2021; Jiang et al., "Mixtral of Experts", 2024;
Qwen2-MoE's shared expert: Qwen team, "Qwen1.5-MoE", 2024).

Routers (ModelConfig.router), as HF transformers' modeling_qwen3_moe / modeling_qwen2_moe / modeling_mixtral compute
them:
    "softmax_topk"  p = softmax(logits) over every expert, the k largest p, optionally divided by their sum
                    (norm_topk_prob; Qwen3-MoE, Qwen2-MoE).
    "topk_softmax"  the k largest logits, then a softmax over those k (Mixtral; equal to softmax_topk with the
                    renormalisation up to rounding).
Without the renormalisation the two orders give different weights (softmax_topk's k weights sum to less than 1).
gpt-oss (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025; HF transformers' modeling_gpt_oss) routes with
"topk_softmax" over logits that carry a bias (ModelConfig.expert_bias: the router and every expert projection have
biases) and runs its experts' clamped SwiGLU (ModelConfig.swiglu_limit, `clamped_swiglu`).

Experts run grouped, never per token and never every expert on every token: the step's (token, slot) rows are
sorted by expert (a stable sort, so each expert's rows keep token order), and each expert with rows gathers its
block of token rows, multiplies it once (gate/up, SiLU-and-mul, down), weights it and adds it into the tokens'
outputs (index_add_), expert after expert in increasing order: each token's sum starts at zero and adds its experts
in HF transformers' order, so fp32 sums round alike. Every block is small (an expert's rows), so the gathers, weights
and adds run in cache, not over the whole step's T * k rows. On the CPU each expert's GEMMs run on oneDNN-packed
weights once engine.quant.after_load.pack_linears has packed them (`GroupedExperts.set_gemms`), else as torch
matmuls on the stacked weights. On CUDA (fp32/fp16/bf16, autograd off, Triton installed) the stacked experts run as
two grouped-GEMM launches instead (engine.kernels.triton_moe.fused_experts): no per-expert loop and no host sync, so
a MoE decode step can be captured in a CUDA graph (`grouped_kernels`, `experts_capturable`). Biased experts with the
clamped SwiGLU (gpt-oss) run there too: each (token, slot) row's expert biases gathered and added after its GEMM
(the down bias before the routing weight, as the loop adds it), the activation in torch between the launches.

Quantized experts (quantization int4 / int8, GGUF Q4 expert tensors under auto, GPTQ / AWQ / compressed-tensors
folders: engine.quant.experts; the router stays in the compute dtype) run as follows. INT4 experts on CUDA with
Triton (both projections INT4) are held once, as the stacked weights (`set_int4`, `int4_experts`:
engine.quant.stacked_int4.StackedInt4, qweight uint8 [E, N, Kp/2], scales and zeros [E, N, Kp/G]), and run as the
grouped W4A16 kernel's two launches (engine.kernels.triton_moe_int4.fused_experts_int4, biases and activation as
above): no host sync, so MoE INT4 decode is captured in CUDA graphs. Elsewhere (the CPU; CUDA without Triton or
with TOKENMILL_TRITON_MOE=0; INT8 experts; a projection that is not INT4) each expert runs its own module
(`set_gemms`: Int4Linear, Int8Linear or nn.Linear) in the per-expert loop, which reads its row counts on the host
(no CUDA graphs).

Parameter names follow llama.cpp's converter for the stacked experts and HF transformers for the rest:
mlp.gate.weight [E, hidden] (router), mlp.experts.{gate,up}_proj.weight [E, I, hidden], mlp.experts.down_proj.weight
[E, hidden, I], mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, hidden]; with biases
mlp.gate.bias [E] and mlp.experts.{gate,up,down}_proj.bias [E, out].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.kernels.triton_moe import DTYPES as TRITON_MOE_DTYPES
from engine.kernels.triton_moe import triton_moe_ops
from engine.kernels.triton_moe_int4 import triton_moe_int4_ops
from engine.layers.expert_weights import ExpertWeights, fuse_gate_up_blocks
from engine.layers.gguf_holder import GGUFBlocksHolder
from engine.layers.rms_norm import fused_ops


def route(logits: torch.Tensor, top_k: int, router: str, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights.

    Args:
        logits: router logits [T, E] (any float dtype; the softmax runs in fp32).
        top_k: experts per token, 1 <= top_k <= E.
        router: "softmax_topk" or "topk_softmax" (module docstring).
        renormalize: with "softmax_topk", divide the k weights by their sum (ignored by "topk_softmax", whose weights
            sum to 1 already).
    Returns:
        (weights fp32 [T, k], expert ids int64 [T, k]), each row's ids in increasing order (weights alike). Ties
        between equal logits go as torch.topk breaks them (as HF transformers', which calls the same op).
    Raises:
        ValueError for an unknown router.
    """
    if router == "softmax_topk":
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif router == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        raise ValueError(f"unknown MoE router {router!r}; tokenmill runs softmax_topk and topk_softmax")
    ids, pos = ids.sort(dim=-1)
    return weights.gather(-1, pos), ids


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's SwiGLU variant, as HF transformers' GptOssExperts computes it: the gate clamped above at `limit`,
    the up projection to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). gate, up [M, I] -> [M, I]."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


Gemm = Callable[[torch.Tensor], torch.Tensor]


def grouped_kernels_serve(x: torch.Tensor) -> bool:
    """Whether the Triton grouped GEMMs may take activation `x`: a CUDA tensor of fp32/fp16/bf16 with autograd off
    (the tests patch this to run the kernels in Triton's interpreter on CPU tensors)."""
    return x.device.type == "cuda" and x.dtype in TRITON_MOE_DTYPES and not torch.is_grad_enabled()


def grouped_gemm_ops(x: torch.Tensor) -> ModuleType | None:
    """engine.kernels.triton_moe when its grouped GEMMs can serve activation `x` (grouped_kernels_serve) and Triton
    is available (triton_moe_ops). None otherwise: the per-expert torch loop runs."""
    return triton_moe_ops() if grouped_kernels_serve(x) else None


def experts_capturable(dtype: torch.dtype, model: nn.Module | None = None) -> bool:
    """Whether a MoE step with CUDA activations of `dtype` can be captured in a CUDA graph: the grouped kernels
    serve every expert block of `model` (when given; GroupedExperts.grouped_kernels: plain stacked experts on
    engine.kernels.triton_moe, INT4 ones on engine.kernels.triton_moe_int4), so no host sync. A block that runs
    per-expert modules (INT8, packed or mixed INT4 / plain experts, or INT4 without Triton) makes it False: the
    per-expert loop reads its row counts on the host."""
    if dtype not in TRITON_MOE_DTYPES or triton_moe_ops() is None:
        return False
    return model is None or all(m.grouped_kernels(dtype) is not None for m in model.modules()
                                if isinstance(m, GroupedExperts))


class GroupedExperts(nn.Module):
    """E SwiGLU experts, down(silu(gate(x)) * up(x)), their weights stacked (ExpertWeights); after `fuse()` gate and
    up are one gate_up_proj [E, 2I, hidden]. With `bias` each projection adds its expert's bias; with
    `swiglu_limit` the experts run `clamped_swiglu(gate, up, swiglu_limit, swiglu_alpha)` instead (gpt-oss).

    forward(x [T, hidden], ids int64 [T, k], weights [T, k] of x's dtype) -> [T, hidden]: sum_j weights[t, j] *
    expert_{ids[t, j]}(x[t]), the rows grouped by expert (module docstring). ids within a row must be distinct and
    increasing (`route` returns them so).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.gate_proj: ExpertWeights | None = ExpertWeights(num_experts, intermediate_size, hidden_size, bias)
        self.up_proj: ExpertWeights | None = ExpertWeights(num_experts, intermediate_size, hidden_size, bias)
        self.down_proj: ExpertWeights | None = ExpertWeights(num_experts, hidden_size, intermediate_size, bias)
        self.gate_up_proj: ExpertWeights | None = None
        self.gemms: tuple[Sequence[Gemm], Sequence[Gemm]] | None = None
        self.packed_biases: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up [E, 2I], down [E, hidden])
        self.int4: tuple[Any, Any] | None = None  # stacked INT4 (gate_up, down): set_gemms, set_int4, int4_experts

    def fuse(self) -> bool:
        """Stack gate_proj and up_proj into one gate_up_proj (one GEMM per expert instead of two). Returns whether it
        fused (False when already fused or packed)."""
        if self.gate_up_proj is not None or self.gate_proj is None:
            return False
        bias = None if self.gate_proj.bias is None else torch.cat([self.gate_proj.bias.detach(),
                                                                    self.up_proj.bias.detach()], dim=1)
        self.gate_up_proj = ExpertWeights.of(torch.cat([self.gate_proj.weight.detach(),
                                                        self.up_proj.weight.detach()], dim=1), bias)
        GGUFBlocksHolder.attach(self.gate_up_proj, fuse_gate_up_blocks(
            GGUFBlocksHolder.of(self.gate_proj), GGUFBlocksHolder.of(self.up_proj), self.num_experts))
        self.gate_proj = self.up_proj = None
        return True

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, hidden], down [E, hidden, I]) weights, fusing first. Raises ValueError once packed (the
        stacked copies are freed then)."""
        self.fuse()
        if self.gate_up_proj is None or self.down_proj is None:
            raise ValueError("the experts' stacked weights were freed when they were packed or quantized (set_gemms, "
                             "set_int4)")
        return self.gate_up_proj.weight, self.down_proj.weight

    def set_gemms(self, gate_up: Sequence[nn.Module], down: Sequence[nn.Module], *,
                  biases: tuple[torch.Tensor, torch.Tensor] | None = None, int4: tuple[Any, Any] | None = None) -> None:
        """Serve expert e with gate_up[e] (x [M, hidden] -> [M, 2I]) and down[e] ([M, I] -> [M, hidden]) and free the
        stacked weights: oneDNN-packed copies of `stacked()` (engine.quant.after_load.pack_linears), or INT4 / INT8
        modules (engine.quant.experts). The modules add no bias: the experts' biases, the stacked weights' or
        `biases` = (gate_up [E, 2I], down [E, hidden]) where those are gone already, are kept and added after them.
        `int4`: the stacked INT4 weights the modules were built from (engine.quant.stacked_int4.StackedInt4: qweight
        uint8 [E, N, Kp/2], scales and zeros [E, N, Kp/G]), as (gate_up, down), None for a projection that is not
        INT4: kept on the device for grouped INT4 kernels (`int4_experts`). Raises ValueError unless there are
        num_experts of each."""
        if len(gate_up) != self.num_experts or len(down) != self.num_experts:
            raise ValueError(f"set_gemms needs {self.num_experts} modules of each kind, got {len(gate_up)} and "
                             f"{len(down)}")
        self._drop_stacked(biases)
        self.packed_gate_up, self.packed_down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.gemms = (self.packed_gate_up, self.packed_down)
        self.int4 = int4

    def set_int4(self, gate_up: Any, down: Any, *, biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Serve the experts from stacked INT4 weights alone (engine.quant.stacked_int4.StackedInt4: gate_up
        [E, 2I, hidden], rows [gate; up] per expert, and down [E, hidden, I] once dequantized) on the grouped W4A16
        kernel (engine.kernels.triton_moe_int4.fused_experts_int4; `grouped_kernels`): no per-expert module, one copy
        of the weights. Frees the stacked weights; `biases` as set_gemms'. Where the kernel does not serve a
        forward (autograd on, a CPU tensor) the per-expert loop dequantizes each expert's weights in turn (exact,
        slow). Raises ValueError when the weights do not fit the block's shape."""
        want = ((self.num_experts, 2 * self.intermediate_size, self.hidden_size),
                (self.num_experts, self.hidden_size, self.intermediate_size))
        for name, w, shape in (("gate_up", gate_up, want[0]), ("down", down, want[1])):
            if (w.num_experts, w.out_features, w.in_features) != shape:
                raise ValueError(f"INT4 {name} experts are [{w.num_experts}, {w.out_features}, {w.in_features}], "
                                 f"the block wants {list(shape)}")
        self._drop_stacked(biases)
        self.gemms = None
        self.int4 = (gate_up, down)

    def _drop_stacked(self, biases: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Free the stacked weights, keeping their biases (or `biases`, where they are gone already)."""
        self.fuse()
        if biases is None and self.gate_up_proj is not None and self.gate_up_proj.bias is not None:
            biases = (self.gate_up_proj.bias.detach(), self.down_proj.bias.detach())
        self.packed_biases = biases
        self.gate_proj = self.up_proj = self.gate_up_proj = self.down_proj = None

    def int4_experts(self) -> tuple[Any, Any] | None:
        """The stacked INT4 weights the experts run from, (gate_up, down): engine.quant.stacked_int4.StackedInt4,
        qweight uint8 [E, N, Kp/2] (element 2j in the high nibble), scales and zeros [E, N, Kp/G], w = (q - 8) *
        scale + zero, N = 2I for gate_up (rows [gate; up] per expert); what
        engine.kernels.triton_moe_int4.fused_experts_int4 takes. None for a projection that is not INT4; None when the
        experts are not INT4, or on the CPU once engine.quant.int4_linear.release_int4_sources dropped them (each
        expert's own Int4Linear serves it there)."""
        return self.int4

    def grouped_kernels(self, dtype: torch.dtype) -> ModuleType | None:
        """The kernels module that serves this block for CUDA activations of `dtype` with autograd off:
        engine.kernels.triton_moe for plain stacked experts, engine.kernels.triton_moe_int4 for INT4 ones (both
        projections INT4: `int4_experts`), each with the experts' biases and clamped SwiGLU where they have them;
        None where the per-expert loop runs (per-expert modules alone: INT8, packed, a projection not INT4; Triton
        missing or TOKENMILL_TRITON_MOE=0; a dtype the kernels do not take)."""
        if dtype not in TRITON_MOE_DTYPES:
            return None
        if self.int4 is not None:
            return triton_moe_int4_ops() if all(w is not None for w in self.int4) else None
        return triton_moe_ops() if self.gemms is None else None

    def _gemm_pair(self, e: int, dtype: torch.dtype) -> tuple[Gemm, Gemm]:
        if self.gemms is not None or self.int4 is not None:
            if self.gemms is not None:
                gu_fn, down_fn = self.gemms[0][e], self.gemms[1][e]
            else:  # set_int4's stacks alone, outside the kernel: expert e's weights dequantized
                gu_w, down_w = (w.expert(e).dequantize(dtype) for w in self.int4)
                gu_fn, down_fn = (lambda x: F.linear(x, gu_w)), (lambda x: F.linear(x, down_w))
            if self.packed_biases is None:
                return gu_fn, down_fn
            gu_b, down_b = self.packed_biases[0][e], self.packed_biases[1][e]
            return (lambda x: gu_fn(x) + gu_b), (lambda x: down_fn(x) + down_b)

        def bias(m: ExpertWeights) -> torch.Tensor | None:
            return None if m.bias is None else m.bias[e]

        if self.gate_up_proj is not None:
            gu, down = self.gate_up_proj.weight[e], self.down_proj.weight[e]
            gu_b, down_b = bias(self.gate_up_proj), bias(self.down_proj)
            return (lambda x: F.linear(x, gu, gu_b)), (lambda x: F.linear(x, down, down_b))
        g, u, down = self.gate_proj.weight[e], self.up_proj.weight[e], self.down_proj.weight[e]
        g_b, u_b, down_b = bias(self.gate_proj), bias(self.up_proj), bias(self.down_proj)
        return ((lambda x: torch.cat((F.linear(x, g, g_b), F.linear(x, u, u_b)), dim=-1)),
                (lambda x: F.linear(x, down, down_b)))

    def _clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """clamped_swiglu of gate_up [M, 2I] (gate columns, then up) -> [M, I]."""
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up_fn, down_fn = self._gemm_pair(e, x.dtype)
        gate_up = gate_up_fn(x)
        if self.swiglu_limit is not None:
            return down_fn(self._clamped_swiglu(gate_up))
        ops = fused_ops(gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return down_fn(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return down_fn(F.silu(gate) * up)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ops = self.grouped_kernels(x.dtype) if grouped_kernels_serve(x) else None
        if ops is not None:
            activation = None if self.swiglu_limit is None else self._clamped_swiglu
            if self.int4 is not None:
                return ops.fused_experts_int4(x, *self.int4, ids, weights, biases=self.packed_biases,
                                              activation=activation)
            gate_up, down = self.stacked()
            biases = None if self.gate_up_proj.bias is None else (self.gate_up_proj.bias, self.down_proj.bias)
            return ops.fused_experts(x, gate_up, down, ids, weights, biases=biases, activation=activation)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) rows grouped by expert, token order kept
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, row_weights = order // k, weights.reshape(-1)[order, None]
        y = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):  # increasing expert order: each token's sum in HF's order
            if n:
                idx = tokens[start:start + n]
                out = self._expert(e, x.index_select(0, idx))
                y.index_add_(0, idx, out.mul_(row_weights[start:start + n]))
                start += n
        return y


class SparseMoE(nn.Module):
    """The sparse MLP block of a mixture-of-experts layer: x [T, hidden] -> [T, hidden].

    Args:
        cfg: ModelConfig with num_experts > 0 (num_experts_per_tok, moe_intermediate_size, router, norm_topk_prob,
            expert_bias, swiglu_limit, swiglu_alpha).
        shared_expert: the dense SwiGLU MLP every token also runs (Qwen2-MoE), gated by
            sigmoid(shared_expert_gate(x)) [T, 1]; None for none.
    Raises ValueError when cfg has no experts.
    """

    def __init__(self, cfg: ModelConfig, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        if cfg.num_experts < 1:
            raise ValueError("SparseMoE needs ModelConfig.num_experts >= 1")
        self.top_k, self.router, self.renormalize = cfg.num_experts_per_tok, cfg.router, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.expert_bias)
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_bias,
                                      cfg.swiglu_limit, cfg.swiglu_alpha)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared_expert is not None else None

    def fuse(self) -> bool:
        """Fuse the experts' gate/up (GroupedExperts.fuse) and the shared expert's. Returns whether anything
        fused."""
        fused = self.experts.fuse()
        if self.shared_expert is not None:
            fused = bool(self.shared_expert.fuse()) or fused
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.router, self.renormalize)
        y = self.experts(x, ids, weights.to(x.dtype))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
