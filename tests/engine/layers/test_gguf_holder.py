"""engine.layers.gguf_holder: GGUFBlocksForm's declared holder of a weight's GGUF blocks until packing. It is a
registered child module that leaves its linear an exact nn.Linear (so INT8 quantization and oneDNN packing still
pick it) and adds nothing to the state dict; a stacked experts' fusion joins gate and up's blocks per expert; a
weight changed after the attach (in place, by `.data`, by a new Parameter) drops them; the experts' packed GEMMs
get their rows of the blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine.kernels.gguf_blocks import GGUFBlocks
from engine.layers.gguf_holder import GGUFBlocksHolder
from engine.layers.moe import GroupedExperts
from engine.quant.after_load import pack_experts, pack_linears
from engine.quant.forms import GGUFBlocksForm
from engine.quant.int8_linear import Int8Linear, int8_available, quantize_model_int8
from engine.quant.packed_linear import PackedLinear, packing_available


def _blocks(type_name: str, n: int, k: int, seed: int = 0) -> GGUFBlocks:
    """Blocks of a random [n, k] weight quantized by gguf-py (the reference writer of the format)."""
    import gguf

    w = np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32)
    return GGUFBlocks.from_raw(gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name]), type_name, (n, k))


def _linear(blocks: GGUFBlocks) -> nn.Linear:
    """An exact nn.Linear whose weight is `blocks` dequantized, with the blocks attached."""
    lin = nn.Linear(blocks.shape[1], blocks.shape[0], bias=False)
    lin.weight = nn.Parameter(blocks.dequantize(), requires_grad=False)
    assert GGUFBlocksForm.attach(lin, blocks)
    return lin


def test_the_holder_is_a_declared_child_that_keeps_the_linear_exact() -> None:
    assert GGUFBlocksForm.holder is GGUFBlocksHolder
    model = nn.Sequential(_linear(_blocks("Q4_0", 32, 64)), nn.ReLU(), _linear(_blocks("Q8_0", 16, 32, seed=1)))
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert {name for name, m in model.named_modules() if isinstance(m, GGUFBlocksHolder)} == {
        "0.gguf_blocks", "2.gguf_blocks"}
    assert set(model.state_dict()) == {"0.weight", "2.weight"}  # the blocks are no parameters or buffers
    assert "GGUFBlocksHolder(Q4_0, rows=(32, 64))" in repr(model)
    assert GGUFBlocksForm.of(model[1]) is None and not GGUFBlocksForm.attach(model[0], None)
    with pytest.raises(ValueError, match="do not fit"):
        GGUFBlocksHolder(_blocks("Q8_0", 16, 32), torch.zeros(16, 32, dtype=torch.bfloat16))
    # A holder does not hide its linear from the passes that pick exact nn.Linear modules: INT8 takes both.
    if int8_available():
        model = _Projections(model[0], model[2])
        assert quantize_model_int8(model) == 2
        assert type(model.up_proj) is Int8Linear and type(model.down_proj) is Int8Linear


class _Projections(nn.Module):
    """Two projections under the names quantize_model_int8 picks, and the embedding whose dtype it reads."""

    def __init__(self, up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.up_proj, self.down_proj, self.embed_tokens = up, down, nn.Embedding(4, 8)


def test_a_new_weight_parameter_drops_the_blocks() -> None:
    lin = _linear(_blocks("Q4_1", 32, 64))
    lin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=False)  # same numbers, another tensor
    assert GGUFBlocksForm.of(lin) is None
    if packing_available():
        model = nn.Sequential(lin)
        assert pack_linears(model) == 1 and isinstance(model[0], PackedLinear) and model[0].blocks is None


def test_fused_experts_join_blocks_per_expert_and_drop_them_when_changed() -> None:
    e, inter, hidden = 2, 32, 64
    experts = GroupedExperts(e, hidden, inter)
    parts = {"gate_proj": _blocks("Q8_0", e * inter, hidden, 1), "up_proj": _blocks("Q8_0", e * inter, hidden, 2),
             "down_proj": _blocks("Q4_0", e * hidden, inter, 3)}
    for name, b in parts.items():
        module = getattr(experts, name)
        rows = module.weight.shape[1]
        module.weight = nn.Parameter(b.dequantize().view(e, rows, -1), requires_grad=False)
        assert GGUFBlocksForm.attach(module, b)
    assert experts.fuse()
    fused = GGUFBlocksForm.of(experts.gate_up_proj)
    assert fused is not None and fused.shape == (e * 2 * inter, hidden)
    assert torch.equal(fused.dequantize().view(e, 2 * inter, hidden), experts.gate_up_proj.weight)
    with torch.no_grad():
        experts.down_proj.weight.mul_(0.5)  # a weight scaled in place after the fill
    assert GGUFBlocksForm.of(experts.down_proj) is None
    if packing_available():
        assert pack_experts(experts)
        gate_up, down = experts.gemms
        for i in range(e):
            assert torch.equal(gate_up[i].blocks.dequantize(), fused.dequantize()[i * 2 * inter:(i + 1) * 2 * inter])
            assert down[i].blocks is None
