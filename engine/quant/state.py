"""Names and helpers every INT4/INT8 layer shares: which parameters are projections, the quantized state dict type
and module replacement (which keeps a replaced projection's bias: AddBias). Near a leaf: it imports no other tokenmill
module but the INT4 weight types (engine.quant.qparams, a leaf, and engine.quant.stacked_int4, which imports only
it), the parameter names EMBEDDING and LM_HEAD, is_linear_weight and is_expert_weight (engine.model.tensor_names,
re-exported here) and, for AddBias.concat, engine.layers.linear (which imports nothing of engine.quant), so the
handler, GPTQ, the tuning and the INT8 path all depend on it and never on each other.

A quantized state dict maps a *module* name (e.g. "layers.0.self_attn.q_proj") to an Int4Weight and every other
parameter name (e.g. "norm.weight") to a plain tensor; a mixture-of-experts block's projection (e.g.
"layers.0.mlp.experts.gate_proj") to a StackedInt4 [E, N, Kp/2] (engine.quant.stacked_int4). On disk each INT4 weight
X becomes three tensors, X.qweight, X.scales and X.zeros (engine.loading.tokenmill_folder).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.tensor_names import (
    EMBEDDING,
    FUSED_MODULES,
    LINEAR_MODULES,
    LM_HEAD,
    is_expert_weight,
    is_linear_weight,
)
from engine.quant.qparams import Int4Weight, Int8Weight
from engine.quant.stacked_int4 import StackedInt4

__all__ = ["EMBEDDING", "FUSED_MODULES", "LINEAR_MODULES", "LM_HEAD", "QuantizedState", "AddBias", "is_expert_weight",
           "is_linear_weight", "set_module"]

QuantizedState = dict[str, "torch.Tensor | Int4Weight | StackedInt4 | Int8Weight"]


class AddBias(nn.Module):
    """y = inner(x) + bias: a bias-carrying projection (Qwen2's q/k/v) served by a kernel without one (Int4Linear,
    Int8Linear, PackedLinear): the bias is added after the GEMM, in the output's dtype. `set_module` wraps
    replacements in it, so no path drops a bias.

    Args:
        inner: the GEMM module, x [..., K] -> [..., N].
        bias: [N] parameter (kept as is: its dtype and device are the model's).
    """

    def __init__(self, inner: nn.Module, bias: nn.Parameter) -> None:
        super().__init__()
        self.inner = inner
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y + self.bias.to(y.dtype)

    @classmethod
    def concat(cls, modules: list[AddBias]) -> AddBias | None:
        """The fused module of several (engine.layers.linear.concat_linears of their inner modules, biases
        concatenated),
        or None when the inner modules cannot be merged."""
        from engine.layers.linear import concat_linears  # engine.layers.linear imports nothing of engine.quant

        inner = concat_linears([m.inner for m in modules])
        if inner is None:
            return None
        return cls(inner, nn.Parameter(torch.cat([m.bias.detach() for m in modules]), requires_grad=False))

    def __getattr__(self, name: str) -> object:
        try:
            return super().__getattr__(name)
        except AttributeError:  # in_features, out_features, ... of the GEMM module
            return getattr(super().__getattr__("inner"), name)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted `name` (e.g. "layers.3.mlp.down_proj") of `model` by `module`.

    When the module replaced carries a bias and `module` has none of its own, `module` is wrapped in AddBias with
    that bias (same parameter name, "<name>.bias"), so quantized and packed kernels never drop it."""
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, attr, None)
    bias = old.bias if isinstance(old, nn.Linear | AddBias) else None
    if bias is not None and getattr(module, "bias", None) is None and not isinstance(module, AddBias):
        module = AddBias(module, bias)
    setattr(owner, attr, module)
