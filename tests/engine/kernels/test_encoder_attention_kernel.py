"""The C++ encoder attention (engine/kernels/csrc/encoder_kernels.cpp): every (row, head) of a packed batch attended
straight from the fused QKV, against torch's SDPA on each row alone (no padding), at head sizes 32 and 64, rows of 1
token up to over 256 (several key blocks and query tiles, none a multiple of either), and the routing rule of
engine.layers.encoder_attention (which CPUs and dtypes take it). The kernel is built for AVX2 + FMA, so it runs on
both CPU kinds of CI; the routing is decided, and tested, per kind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.layers.encoder_attention as ea
from engine.kernels import cpu_kernels
from engine.layers.encoder_attention import EncoderMetadata, encoder_attention


def rows_alone(qkv: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """SDPA of each row by itself (exact fp32 reference: no mask, no padding), packed back to [T, heads * dim]."""
    outs, start = [], 0
    for n in lens:
        q, k, v = qkv[start:start + n].permute(1, 2, 0, 3)  # each [heads, n, dim]
        outs.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("lens", [[1], [5, 3, 1], [17, 16, 15, 2], [300, 129, 64, 7, 1]])
def test_kernel_equals_each_row_attended_alone(encoder_ops: object, head_dim: int, lens: list[int]) -> None:
    torch.manual_seed(len(lens) * head_dim)
    qkv = torch.randn(sum(lens), 3, 384 // head_dim, head_dim) * 2  # scores of a few units: a peaked softmax too
    cu = torch.tensor([0, *lens]).cumsum(0)
    out = encoder_ops.encoder_attention(qkv, cu, head_dim ** -0.5)
    torch.testing.assert_close(out, rows_alone(qkv, lens), rtol=1e-4, atol=2e-5)  # fp32, summed in another order


def test_kernel_refuses_what_it_does_not_take(encoder_ops: object) -> None:
    qkv = torch.randn(6, 3, 2, 32)
    with pytest.raises(RuntimeError, match="every row needs >= 1 token"):
        encoder_ops.encoder_attention(qkv, torch.tensor([0, 0, 6]), 1.0)
    with pytest.raises(RuntimeError, match="end at T"):
        encoder_ops.encoder_attention(qkv, torch.tensor([0, 5]), 1.0)
    with pytest.raises(RuntimeError, match="head_dim 32 or 64"):
        encoder_ops.encoder_attention(torch.randn(6, 3, 4, 16), torch.tensor([0, 6]), 1.0)
    with pytest.raises(RuntimeError, match="fp32"):
        encoder_ops.encoder_attention(qkv.bfloat16(), torch.tensor([0, 6]), 1.0)


def test_routing_takes_the_kernel_for_fp32_without_avx512(encoder_ops: object, monkeypatch: pytest.MonkeyPatch) -> None:
    lens = [9, 4, 4]
    meta = EncoderMetadata.of(lens, torch.device("cpu"))
    qkv = torch.randn(sum(lens), 3, 12, 32)
    monkeypatch.setattr(cpu_kernels, "cpu_has_avx512", lambda: False)
    with torch.inference_mode():
        assert ea.packed_kernel(qkv, meta) is encoder_ops
        assert ea.packed_kernel(qkv.bfloat16(), meta) is None  # bf16: SDPA
        assert ea.packed_kernel(qkv, meta.windowed(2)) is None  # a sliding window: SDPA's band mask
        assert ea.packed_kernel(torch.randn(17, 3, 4, 96), meta) is None  # a head size it is not built for
        assert ea.packed_kernel(torch.randn(17, 3, 6, 64), meta) is encoder_ops  # head_dim 64 on short rows
        long_rows = EncoderMetadata.of([256, 100], torch.device("cpu"))
        assert ea.packed_kernel(torch.randn(356, 3, 6, 64), long_rows) is None  # where SDPA is as fast
        assert ea.packed_kernel(torch.randn(356, 3, 12, 32), long_rows) is encoder_ops
        torch.testing.assert_close(encoder_attention(qkv, meta), rows_alone(qkv, lens), rtol=1e-4, atol=2e-5)
    assert ea.packed_kernel(qkv, meta) is None  # autograd on: the kernel has no backward
    monkeypatch.setattr(cpu_kernels, "cpu_has_avx512", lambda: True)
    with torch.inference_mode():
        assert ea.packed_kernel(qkv, meta) is None  # AVX-512: SDPA (the kernel is not measured there)
