"""StackedInt4 (engine.quant.stacked_int4): per-expert Int4Weights stacked, act-order kept per expert, and the
mismatches it refuses. Its kernel is tested in tests/engine/kernels/test_triton_moe_int4.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.quant.qparams import Int4Weight, quantize_int4
from engine.quant.stacked_int4 import StackedInt4


def _weights(experts: int, out_f: int, in_f: int, group_size: int, seed: int = 0) -> list[Int4Weight]:
    g = torch.Generator().manual_seed(seed)
    return [quantize_int4(torch.randn(out_f, in_f, generator=g), group_size, method="minmax") for _ in range(experts)]


def test_stacking_keeps_each_expert_and_its_dequantization() -> None:
    weights = _weights(3, 10, 72, 32)
    stacked = StackedInt4.from_weights(weights)
    assert (stacked.num_experts, stacked.out_features, stacked.in_features) == (3, 10, 72)
    assert stacked.qweight.shape == (3, 10, 48) and stacked.scales.shape == (3, 10, 3)
    assert stacked.padded_in_features == 96 and stacked.in_perm is None
    want = torch.stack([w.dequantize() for w in weights])
    assert torch.equal(stacked.dequantize(), want)
    assert torch.equal(stacked.expert(2).qweight, weights[2].qweight)
    half = stacked.to("cpu", torch.float16)
    assert half.scales.dtype == half.zeros.dtype == torch.float16 and half.qweight is stacked.qweight


def test_act_order_experts_get_a_permutation_each_and_the_rest_the_identity() -> None:
    weights = _weights(3, 8, 40, 32)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    weights[1] = dataclasses.replace(weights[1], in_perm=perm)
    stacked = StackedInt4.from_weights(weights)
    assert stacked.in_perm is not None and stacked.in_perm.shape == (3, 40)
    assert torch.equal(stacked.in_perm[1], perm)
    assert torch.equal(stacked.in_perm[0], torch.arange(40)) and torch.equal(stacked.in_perm[2], torch.arange(40))
    # the identity changes nothing: each expert dequantizes as its own Int4Weight does
    assert torch.equal(stacked.dequantize(), torch.stack([w.dequantize() for w in weights]))


def test_mismatched_experts_are_refused() -> None:
    with pytest.raises(ValueError, match="got none"):
        StackedInt4.from_weights([])
    with pytest.raises(ValueError, match="expert 1's INT4 weight"):
        StackedInt4.from_weights(_weights(1, 8, 64, 32) + _weights(1, 8, 64, 64))
    with pytest.raises(ValueError, match="expert 2's INT4 weight"):
        StackedInt4.from_weights(_weights(2, 8, 64, 32) + _weights(1, 8, 60, 32))
    bf16 = _weights(1, 8, 64, 32)
    with pytest.raises(ValueError, match="expert 1's INT4 weight"):
        StackedInt4.from_weights(bf16 + [bf16[0].to(scale_dtype=torch.float32)])


def test_bad_parts_are_named() -> None:
    s = StackedInt4.from_weights(_weights(2, 8, 64, 32))
    with pytest.raises(ValueError, match="qweight must be uint8 \\[8, 64\\] for in_features 100"):
        dataclasses.replace(s, in_features=100)
    with pytest.raises(ValueError, match="scales must be \\[8, 2\\]"):
        dataclasses.replace(s, scales=s.scales[:, :, :1])
    with pytest.raises(ValueError, match="share one float dtype"):
        dataclasses.replace(s, zeros=s.zeros.float())
    with pytest.raises(ValueError, match="in_perm must be stacked over the experts"):
        dataclasses.replace(s, in_perm=torch.arange(64))
    with pytest.raises(ValueError, match="in_perm must be int64 \\[64\\]"):
        dataclasses.replace(s, in_perm=torch.arange(64).int().expand(2, 64))
    with pytest.raises(ValueError, match="zeros must be stacked over the experts"):
        dataclasses.replace(s, zeros=s.zeros[:1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.group_size = 64  # type: ignore[misc]
