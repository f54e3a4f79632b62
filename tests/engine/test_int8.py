"""INT8 W8A8 on the CPU (engine.quant.int8_linear): the kernel pieces against plain torch, then the real model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cpu_kernels import cpu_ops
from engine.quant.int8_linear import Int8Linear, int8_available, quantize_activations_int8

pytestmark = pytest.mark.skipif(not int8_available(), reason="torch without oneDNN's int8 ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_quantizes_rows_as_torch_does(dtype: torch.dtype) -> None:
    ops = cpu_ops()
    if ops is None:
        pytest.fail("the CPU kernels did not build (g++ and ninja are test dependencies)")
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 200, generator=gen) * torch.logspace(-2, 2, 33)[:, None]).to(dtype)
    x[3] = 0  # an all-zero row keeps a tiny positive scale
    q, scales = ops.quantize_rows_u8(x)
    q_ref, scales_ref = quantize_activations_int8(x)
    assert q.dtype == torch.uint8 and scales.shape == (33, 1)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q, q_ref)


def test_int8_linear_is_close_to_fp32_and_each_row_is_its_own() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 576, generator=gen) * 0.05
    x = torch.randn(64, 576, generator=gen)
    lin = Int8Linear(weight, torch.float32)
    with torch.inference_mode():
        y = lin(x)
        alone = lin(x[5:6])
        ref = F.linear(x, weight)
        err = (y - ref).norm() / ref.norm()
        assert err < 0.02
        # An outlier channel, as real activations have, spends the row's 8 bits: what SmoothQuant moves away.
        x[:, 7] *= 20
        err_outlier = (lin(x) - F.linear(x, weight)).norm() / F.linear(x, weight).norm()
    assert 2 * err < err_outlier < 0.08
    # Per-token scales: a row's result does not depend on the rest of the batch (fbgemm's dynamic linear, with one
    # scale per tensor, would fail this).
    assert torch.equal(alone[0], y[5])
    with pytest.raises(ValueError, match="2-D CPU weight"):
        Int8Linear(weight[None], torch.float32)


@pytest.mark.slow
def test_int8_model_follows_the_fp32_model_on_real_text(engine: LLMEngine, gguf_path: str,
                                                        alpaca_instructions: list[str]) -> None:
    from engine.perplexity import text_perplexity

    int8 = LLMEngine.from_model(gguf_path, EngineConfig(device="cpu", dtype="float32", quantization="int8"))
    model = int8.runner.model
    assert all(type(m).__name__ == "Int8Linear" for layer in model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                         layer.mlp.down_proj))
    assert type(model.lm_head).__name__ == "PackedLinear"  # the LM head stays in the compute dtype
    texts = alpaca_instructions[:150]
    ppl_fp32 = text_perplexity(engine.runner.model, engine.tokenizer, texts, context=512)
    ppl_int8 = text_perplexity(int8.runner.model, int8.tokenizer, texts, context=512)
    assert ppl_int8.tokens == ppl_fp32.tokens > 1000
    assert abs(ppl_int8.perplexity / ppl_fp32.perplexity - 1) < 0.03
    outs = int8.generate(alpaca_instructions[:4], SamplingParams(max_tokens=16))
    assert all(o.finish_reason in ("stop", "length") and o.text.strip() for o in outs)
