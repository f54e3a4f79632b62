"""Names and helpers every INT4/INT8 layer shares: which parameters are projections, the quantized state dict type
and module replacement. A leaf: it imports no other tokenmill module but the INT4 weight type (engine.quant.qparams,
itself a leaf), so the handler, GPTQ, the tuning and the INT8 path all depend on it and never on each other.

A quantized state dict maps a *module* name (e.g. "layers.0.self_attn.q_proj") to an Int4Weight and every other
parameter name (e.g. "norm.weight") to a plain tensor. On disk each Int4Weight X becomes three tensors, X.qweight,
X.scales and X.zeros (engine.quant.folder).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.qparams import Int4Weight

LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "gate_up_proj")  # the serving layout (LlamaModel.fuse_projections)
EMBEDDING = "embed_tokens"
LM_HEAD = "lm_head"

QuantizedState = dict[str, "torch.Tensor | Int4Weight"]


def is_linear_weight(name: str) -> bool:
    """True for the weight of a decoder projection (fused or not) or the LM head (HF names without "model.")."""
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and (module.rsplit(".", 1)[-1] in LINEAR_MODULES + FUSED_MODULES
                                         or module == LM_HEAD)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted `name` (e.g. "layers.3.mlp.down_proj") of `model` by `module`."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
