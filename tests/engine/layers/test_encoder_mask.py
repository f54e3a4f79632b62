"""The additive mask encoder attention hands SDPA (engine.layers.encoder_attention.EncoderMetadata.mask_bias): 0 where
a query may attend a key, -inf where not, built once per dtype, and the same attention as the bool mask it replaces
on real-length rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.encoder_attention import EncoderMetadata, encoder_attention


def test_mask_bias_is_the_key_mask_as_zeros_and_minus_infinity() -> None:
    meta = EncoderMetadata.of([5, 3, 1], torch.device("cpu"))
    bias = meta.mask_bias(torch.float32)
    assert bias.shape == (3, 1, 1, 5) and bias.dtype == torch.float32
    assert torch.equal(bias == 0, meta.key_mask) and torch.isneginf(bias[~meta.key_mask]).all()
    assert meta.mask_bias(torch.float32) is bias  # built once, shared by every layer
    assert meta.mask_bias(torch.bfloat16).dtype == torch.bfloat16
    assert EncoderMetadata.of([4, 4], torch.device("cpu")).mask_bias(torch.float32) is None  # no padding, no mask


def test_a_windowed_batch_gets_its_band_not_the_key_mask() -> None:
    meta = EncoderMetadata.of([6, 2], torch.device("cpu"))
    meta.mask_bias(torch.float32)  # cached on the full-attention metadata first
    band = meta.windowed(1)
    assert torch.equal(band.mask_bias(torch.float32) == 0, band.attn_mask)
    assert band.mask_bias(torch.float32).shape == (2, 1, 6, 6)
    assert torch.equal(meta.mask_bias(torch.float32) == 0, meta.key_mask)  # the full layers' mask unchanged


def test_encoder_attention_equals_sdpa_with_the_bool_mask_row_by_row() -> None:
    torch.manual_seed(0)
    lens = [7, 4, 1, 6]
    meta = EncoderMetadata.of(lens, torch.device("cpu"))
    qkv = torch.randn(sum(lens), 3, 2, 8)
    out = encoder_attention(qkv, meta)
    start = 0
    for n in lens:  # each row alone, unpadded: what the packed batch must equal
        q, k, v = qkv[start:start + n].permute(1, 2, 0, 3)  # each [heads, n, dim]
        want = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, 16)
        torch.testing.assert_close(out[start:start + n], want, rtol=1e-5, atol=1e-6)
        start += n
