"""The declared holder of a weight's GGUF blocks until packing: GGUFBlocksHolder, the child module "gguf_blocks" of
an nn.Linear or of a mixture-of-experts block's stacked projection (engine.layers.expert_weights.ExpertWeights).

The GGUF blocks form (engine.quant.forms.GGUFBlocksForm) keeps a Q4_0 / Q4_1 / Q8_0 / Q4_K weight's own blocks beside
its fp32 copy for the CPU's small-batch kernel. Between the fill (engine.model.fill.attach_gguf_blocks) and packing
(engine.quant.after_load.pack_linears, which hands the blocks to GGUFBlocksForm.process_after_load) the blocks ride
on the module that holds the weight, as this registered child: the module stays an exact nn.Linear (so the checks
`type(m) is nn.Linear` that pick the linears to pack or quantize still see it), the holder shows in `print(model)`
and `named_modules()`, and it adds nothing to the state dict. GGUFBlocksForm declares it as its holder
(`GGUFBlocksForm.holder`, `attach`, `of`); the fill and the projection fusions (engine.layers.linear.concat_linears,
engine.layers.moe.GroupedExperts.fuse) sit below engine.quant and use this class directly.

The holder records the weight's version counter and storage address when it is attached: a later change of the
weight (SmoothQuant's in-place scaling, GPTQ's `weight.data = ...`, a new Parameter) makes `of` answer None, so no
kernel multiplies by stale blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine.kernels.gguf_blocks import GGUFBlocks


def rows_shape(weight: torch.Tensor) -> tuple[int, int]:
    """A weight's shape as rows: [N, K] as it is, stacked experts [E, N, K] as [E * N, K]."""
    return (weight.numel() // weight.shape[-1], weight.shape[-1]) if weight.dim() else (0, 0)


def _fits(weight: object, blocks: GGUFBlocks) -> bool:
    """Whether `weight` is an fp32 tensor whose rows (`rows_shape`) are the blocks' [N, K]."""
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and rows_shape(weight) == blocks.shape


class GGUFBlocksHolder(nn.Module):
    """The GGUF blocks of its parent's `weight` (module docstring), registered as the parent's child `ATTRIBUTE`.

    Args:
        blocks: the weight's blocks [N, K] (stacked experts [E, N, K]: blocks [E * N, K]).
        weight: the fp32 weight they are the blocks of, whose version counter and storage address are recorded.
    Raises ValueError when `weight` is not fp32 or its rows are not the blocks' shape.
    """

    ATTRIBUTE = "gguf_blocks"

    def __init__(self, blocks: GGUFBlocks, weight: torch.Tensor) -> None:
        super().__init__()
        if not _fits(weight, blocks):
            raise ValueError(f"GGUF blocks {blocks.shape} do not fit a {getattr(weight, 'dtype', None)} weight of "
                             f"shape {tuple(getattr(weight, 'shape', ()))}; attach blocks to the fp32 weight they "
                             "were read with")
        self.blocks = blocks
        self.version, self.address = weight._version, weight.data_ptr()

    def blocks_for(self, weight: object) -> GGUFBlocks | None:
        """The blocks when `weight` is still the one they were attached to (same version, storage, shape, fp32)."""
        if (not _fits(weight, self.blocks) or weight._version != self.version
                or weight.data_ptr() != self.address):
            return None
        return self.blocks

    def extra_repr(self) -> str:
        return f"{self.blocks.type_name}, rows={self.blocks.shape}"

    @classmethod
    def attach(cls, module: nn.Module, blocks: GGUFBlocks | None) -> bool:
        """Register the holder of `blocks` on `module` (an nn.Linear or ExpertWeights with an fp32 `weight` of their
        rows' shape). Returns False, attaching nothing, for no blocks or a weight they do not fit."""
        weight = getattr(module, "weight", None)
        if blocks is None or not _fits(weight, blocks):
            return False
        module.add_module(cls.ATTRIBUTE, cls(blocks, weight))
        return True

    @classmethod
    def of(cls, module: nn.Module) -> GGUFBlocks | None:
        """The blocks attached to `module`, or None when it has none or its weight changed since."""
        holder = getattr(module, "_modules", {}).get(cls.ATTRIBUTE)
        return holder.blocks_for(getattr(module, "weight", None)) if isinstance(holder, cls) else None

    @classmethod
    def concat(cls, modules: Sequence[nn.Module], merged: nn.Module) -> bool:
        """Attach to `merged` (whose weight is the modules' weights concatenated along out_features) their blocks
        concatenated alike (GGUFBlocks.concat), when every module has current ones of one type. Returns whether it
        attached."""
        parts = [cls.of(m) for m in modules]
        if any(b is None for b in parts):
            return False
        return cls.attach(merged, GGUFBlocks.concat(parts))
