"""The encoder's elementwise C++ kernels (engine/kernels/csrc/encoder_kernels.cpp) against the torch ops they replace:
bias + exact GELU (its erf a rational approximation: checked over the whole line, tails, infinities and NaN), bias +
residual + LayerNorm; in place, on rows of several widths. Built for AVX2 + FMA: they run on both CPU kinds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def test_bias_gelu_is_exact_gelu_over_the_whole_line(encoder_ops: object) -> None:
    x = torch.linspace(-30, 30, 240_008, dtype=torch.float64).view(-1, 8)  # rows of 8: the erf's every regime
    y = x.float().clone()
    out = encoder_ops.bias_gelu_(y, torch.zeros(8))
    assert out.data_ptr() == y.data_ptr()  # in place
    want = F.gelu(x)  # exact (erf) GELU in fp64
    assert (out.double() - want).abs().max() < 2e-6  # near 0 the erf's 4.5e-7 times |x| / 2
    assert ((out.double() - want).abs() / want.abs().clamp_min(1)).max() < 1e-6
    assert out[x < -8].abs().max() < 1e-5 and torch.equal(out[x > 8], x.float()[x > 8])  # the tails
    special = torch.tensor([[float("nan"), float("inf"), 0.0, -0.0, 1.0, -1.0, 3.9999, -3.9999]])
    got = encoder_ops.bias_gelu_(special.clone(), torch.zeros(8))
    torch.testing.assert_close(got, F.gelu(special), equal_nan=True, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("width", [8, 384, 1536])
def test_bias_gelu_adds_the_bias_first(encoder_ops: object, width: int) -> None:
    torch.manual_seed(width)
    y, bias = torch.randn(37, width) * 3, torch.randn(width)
    want = F.gelu(y + bias)
    torch.testing.assert_close(encoder_ops.bias_gelu_(y, bias), want, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("width", [8, 384, 1024])
def test_bias_residual_layer_norm_is_layer_norm_of_the_sum(encoder_ops: object, width: int) -> None:
    torch.manual_seed(width)
    y, residual, bias = torch.randn(33, width) * 4 + 2, torch.randn(33, width), torch.randn(width)
    gamma, beta = torch.randn(width), torch.randn(width)
    want = F.layer_norm(y + bias + residual, (width,), gamma, beta, 1e-12)
    out = encoder_ops.bias_residual_layer_norm_(y, bias, residual, gamma, beta, 1e-12)
    assert out.data_ptr() == y.data_ptr()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    same = torch.full((2, width), 3.0)  # a constant row: variance 0, eps alone keeps it finite
    out = encoder_ops.bias_residual_layer_norm_(same, torch.zeros(width), torch.zeros(2, width), gamma, beta, 1e-5)
    torch.testing.assert_close(out, beta.expand(2, width), atol=1e-6, rtol=0)


def test_elementwise_kernels_refuse_what_they_do_not_take(encoder_ops: object) -> None:
    with pytest.raises(RuntimeError, match="multiple of 8"):
        encoder_ops.bias_gelu_(torch.randn(4, 12), torch.randn(12))
    with pytest.raises(RuntimeError, match=r"contiguous fp32 \[N\]"):
        encoder_ops.bias_gelu_(torch.randn(4, 16), torch.randn(8))
    with pytest.raises(RuntimeError, match="residual"):
        encoder_ops.bias_residual_layer_norm_(torch.randn(4, 16), torch.randn(16), torch.randn(3, 16), torch.ones(16),
                                      torch.zeros(16), 1e-5)
