"""The CPU serving path: the C++ paged decode attention (engine/kernels/csrc) and oneDNN-packed linears, each against
the
plain torch computation it replaces, then the whole engine on real prompts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_steps import dense_attention, make_step, poison_outside_windows
from torch import nn

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels.cpu_kernels import cpu_ops
from engine.layers.attention import paged_attention_cpu, paged_attention_ref
from engine.layers.linear import linear_gelu
from engine.quant.after_load import pack_linears
from engine.quant.packed_linear import PackedLinear, can_pack, packing_available

# Max abs error vs the reference: fp32 differs by summation order; bf16 outputs round to 8 bits of mantissa.
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    built = cpu_ops()
    if built is None:
        pytest.fail("the CPU kernels did not build (g++ and ninja are test dependencies); see the warning above")
    return built


# (query_lens, seq_lens): decodes lead, as the model runner orders them. Contexts of 1 token, under one block,
# and over several blocks, none a multiple of the block size; then decodes followed by a chunked and a full prefill.
STEPS = [([1] * 5, [1, 13, 16, 37, 70]), ([1, 1, 1, 21, 40], [9, 33, 120, 30, 40])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# group 8 and 5 with head_dim 64 / 128: the value sum's passes of 4 / 2 heads, and a shorter last pass.
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64), (4, 4, 64), (6, 2, 40), (16, 2, 64), (10, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("step", STEPS)
def test_cpu_attention_matches_the_reference(ops: object, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                             head_dim: int, block_size: int,
                                             step: tuple[list[int], list[int]]) -> None:
    # head_dim 40 takes the kernel's scalar path (not a multiple of 16 lanes).
    q, kc, vc, meta = make_step(*step, num_heads, num_kv_heads, block_size, dtype, head_dim=head_dim)
    scale = head_dim ** -0.5
    out = paged_attention_cpu(q, kc, vc, meta, scale)
    ref = paged_attention_ref(q, kc, vc, meta, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    assert (out.float() - ref.float()).abs().max().item() < ATOL[dtype]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (16, 2, 128)])
@pytest.mark.parametrize("step", STEPS)
def test_cpu_kernel_reads_fp16_caches(ops: object, num_heads: int, num_kv_heads: int, head_dim: int,
                                      step: tuple[list[int], list[int]]) -> None:
    # fp16 caches are widened with F16C on AVX2 (8 lanes at a time) and elementwise elsewhere; every row, prefill
    # chunks included, goes to the kernel here. fp16 outputs keep 11 bits of mantissa: 2e-3 at these magnitudes.
    q, kc, vc, meta = make_step(*step, num_heads, num_kv_heads, 16, torch.float16, head_dim=head_dim)
    scale = head_dim ** -0.5
    out = ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, 0)
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, scale)
    assert out.dtype == torch.float16
    assert (out.float() - ref).abs().max().item() < 2e-3


def test_cpu_kernel_reads_strided_queries_and_long_contexts(ops: object) -> None:
    # q as the model passes it: a view of the fused QKV output (row stride > num_heads * head_dim); decodes after
    # and before prefill chunks, one chunk longer than a work item's 8 rows.
    query_lens, seq_lens = [1, 19, 1, 3], [700, 40, 1, 333]
    _, kc, vc, meta = make_step(query_lens, seq_lens, 6, 2, 16, torch.float32, seed=3)
    qkv = torch.randn(sum(query_lens), 6 + 2 * 2, 64)
    q = qkv[:, :6]
    scale = 0.125
    out = ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, 0)
    assert (out - paged_attention_ref(q.contiguous(), kc, vc, meta, scale)).abs().max().item() < ATOL[torch.float32]
    with pytest.raises(RuntimeError, match="seq_len >= its rows"):
        ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens - 20, meta.query_start_loc, scale, 0)


WINDOW_STEPS = STEPS + [([1, 19, 1, 3], [700, 40, 1, 333])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 40), (10, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("step", WINDOW_STEPS)
def test_cpu_kernel_sliding_window_skips_blocks_before_it(ops: object, dtype: torch.dtype, num_heads: int,
                                                          num_kv_heads: int, head_dim: int, block_size: int,
                                                          window: int, step: tuple[list[int], list[int]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Against the dense masked oracle; then the blocks wholly before every query's window are set to NaN: the
    # kernel must not read them (it starts at the window's first block), so its output is unchanged. Every chunk
    # through the kernel, on every CPU kind (without AVX-512 the engine sends prefill chunks to SDPA instead).
    monkeypatch.setattr("engine.layers.attention.CPU_KERNEL_MAX_PREFILL_PAIRS", 1 << 62)
    q, kc, vc, meta = make_step(*step, num_heads, num_kv_heads, block_size, dtype, head_dim=head_dim)
    scale = head_dim ** -0.5
    oracle = dense_attention(q, kc, vc, meta, scale, window)
    out = paged_attention_cpu(q, kc, vc, meta, scale, sliding_window=window)
    assert out.dtype == dtype and (out.float() - oracle.float()).abs().max().item() < ATOL[dtype]
    if poison_outside_windows(kc, vc, meta, window):
        assert torch.equal(paged_attention_cpu(q, kc, vc, meta, scale, sliding_window=window), out)
    elif window == 1000:  # no block to poison: the window covers every sequence, which is full causal attention
        assert torch.equal(out, paged_attention_cpu(q, kc, vc, meta, scale))


def test_cpu_attention_sends_long_prefill_chunks_to_sdpa(ops: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.layers.attention

    monkeypatch.setattr(engine.layers.attention, "CPU_KERNEL_MAX_PREFILL_PAIRS", 100)
    for query_lens, seq_lens in (([1, 1, 21, 5], [9, 40, 21, 30]), ([21, 1, 5], [21, 40, 30])):
        q, kc, vc, meta = make_step(query_lens, seq_lens, 6, 2, 16, torch.float32)
        out = paged_attention_cpu(q, kc, vc, meta, 0.125)
        assert (out - paged_attention_ref(q, kc, vc, meta, 0.125)).abs().max().item() < ATOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_kernels_compute_the_decoder_ops(ops: object, dtype: torch.dtype) -> None:
    # Each fused op against the torch ops it replaces (the attention and MLP blocks with autograd on take the torch
    # path), on activations of real scale. The kernels round once where torch rounds after every op, and sum in
    # another order.
    from engine.layers.rms_norm import RMSNorm
    from engine.layers.rope import apply_rope

    gen = torch.Generator().manual_seed(0)
    rows, hidden, inter, heads, kv_heads, head_dim = 37, 96, 160, 6, 2, 16
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    res = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    with torch.no_grad():
        fused_out, fused_sum = norm(x, residual=res)
        fused_plain = norm(x)
    ref_sum = res + x
    with torch.enable_grad():
        ref_out, ref_plain = norm._norm(ref_sum).detach(), norm._norm(x).detach()
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    assert torch.equal(fused_sum, ref_sum)
    torch.testing.assert_close(fused_out, ref_out, **tol)
    torch.testing.assert_close(fused_plain, ref_plain, **tol)

    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    silu_ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(ops.silu_and_mul(gate_up), silu_ref, **tol)

    # RoPE of Q and K from a fused QKV row (a strided view, as the model passes it), K/V into a paged cache.
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim + 8, generator=gen)).to(dtype)[:, 8:]
    angles = torch.randn(rows, head_dim // 2, generator=gen) * 3
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    block_size, num_blocks = 4, 12
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    q = ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads)
    qk = qkv[:, :(heads + kv_heads) * head_dim].reshape(rows, heads + kv_heads, head_dim)
    rotated = apply_rope(qk, cos, sin)
    torch.testing.assert_close(q, rotated[:, :heads], **tol)
    torch.testing.assert_close(k_cache.view(-1, kv_heads, head_dim)[slots], rotated[:, heads:], **tol)
    # partial rotary (Phi-4-mini): the first 3/4 of each head rotate, the rest pass through unchanged
    rot = head_dim * 3 // 4 // 2 * 2
    part = ops.rope_write_kv(qkv, cos[:, :rot].contiguous(), sin[:, :rot].contiguous(), k_cache, v_cache, slots, heads)
    rotated = apply_rope(qk, cos[:, :rot], sin[:, :rot])
    torch.testing.assert_close(part, rotated[:, :heads], **tol)
    torch.testing.assert_close(k_cache.view(-1, kv_heads, head_dim)[slots], rotated[:, heads:], **tol)
    assert torch.equal(part[..., rot:], qk[:, :heads, rot:]) and not torch.equal(part[..., :rot], qk[:, :heads, :rot])
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(rows, kv_heads, head_dim)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], v)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, kv_heads, head_dim)[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_torch_argmax(ops: object, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # Real logits' shape (SmolLM2's vocabulary) and short rows that end inside and before one 16-lane vector.
    for rows, cols in [(64, 49152), (7, 37), (3, 16), (2, 5), (1, 1)]:
        x = torch.randn(rows, cols, generator=gen).to(dtype)
        x[0, cols // 2] = x[0].max()  # a tie: the first index wins
        if rows > 2:
            x[1] = float("-inf")  # all -inf: index 0
            x[2, -1] = x[2, cols // 3] = float("nan")  # NaN counts as the largest; the first NaN wins
        assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1)), (dtype, rows, cols)
    wide = torch.randn(4, 100, generator=gen).to(dtype)
    assert torch.equal(ops.argmax_rows(wide[:, 10:90]), wide[:, 10:90].argmax(dim=-1))  # strided rows


@pytest.mark.skipif(not packing_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_computes_the_linear(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 80, generator=gen) * 0.1).to(dtype)
    if not can_pack(dtype):  # bf16 on a CPU without AVX512BW/VL/DQ or AVX-NE-CONVERT: refused, and left unpacked
        with pytest.raises(ValueError, match="cannot pack bf16"):
            PackedLinear(weight)
        model = nn.Sequential(nn.Linear(80, 96, bias=False)).to(dtype)
        assert pack_linears(model) == 0 and type(model[0]) is nn.Linear
        return
    packed = PackedLinear(weight)
    for rows in (1, 7, 64, 300):
        x = torch.randn(2, rows, 80, generator=gen).to(dtype)
        ref = F.linear(x, weight)
        y = packed(x)
        assert y.shape == ref.shape and y.dtype == dtype
        if dtype == torch.bfloat16:
            assert torch.equal(y, ref)  # both are oneDNN's bf16 GEMM
        else:
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fp32/bf16 CPU weight"):
        PackedLinear(weight.half())


@pytest.mark.skipif(not packing_available(), reason="torch without oneDNN")
def test_pack_linears_replaces_plain_linears_and_keeps_their_biases() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=True),
                          nn.Sequential(nn.Linear(8, 8, bias=False)))
    x = torch.randn(5, 8)
    with torch.no_grad():
        expected = model[2](x)  # a QKV with a bias (Qwen2): packed, the bias added in the GEMM's epilogue
        gelu = F.gelu(expected)
    assert pack_linears(model) == 3
    assert isinstance(model[1], PackedLinear) and isinstance(model[3][0], PackedLinear)
    assert isinstance(model[2], PackedLinear) and model[2].bias is not None and model[1].bias is None
    assert set(model.state_dict()) == {"0.weight", "2.bias"}  # the bias keeps its name; packed weights are no state
    with torch.no_grad():
        torch.testing.assert_close(model[2](x), expected, rtol=1e-5, atol=1e-6)
        for epilogue in (True, False):  # oneDNN's GELU epilogue (AVX-512 CPUs), or GELU in place after the GEMM
            model[2].gelu_epilogue = epilogue
            torch.testing.assert_close(model[2].forward_gelu(x), gelu, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(linear_gelu(model[2], x), gelu, rtol=1e-5, atol=1e-6)
        plain = nn.Linear(8, 8)  # no epilogue: GELU in place on its output (torch's, or without AVX-512 our C++
        # bias_gelu_, whose erf is within 4.5e-7 of the exact one: tests/engine/kernels/test_encoder_elementwise.py)
        torch.testing.assert_close(linear_gelu(plain, x), F.gelu(plain(x)), rtol=1e-6, atol=1e-6)
    assert type(model[0]) is nn.Embedding
    assert pack_linears(model) == 0  # idempotent


@pytest.mark.slow
def test_cpu_serving_path_gives_the_reference_greedy_tokens(engine: LLMEngine,
                                                            gsm8k_questions: list[str]) -> None:
    # The default CPU path (C++ decode attention, packed fp32 GEMMs) against the torch reference attention on the
    # same weights, on real prompts in one continuous batch (prefill chunks mixed with decodes).
    # NOTE: engines made by with_config share the model, and the newest one sets its attention function.
    # 8 prompts of ~90 tokens in 256-token steps: 3 steps of prefill chunks, the later ones beside decodes; 12 tokens
    # each (the decodes after the prefill only repeat the steps of 8 rows).
    prompts = gsm8k_questions[:8]
    params = SamplingParams(max_tokens=12)
    ours_engine = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=256))
    assert ours_engine.runner.attn_fn is paged_attention_cpu
    assert isinstance(ours_engine.runner.model.lm_head, PackedLinear)
    ours = ours_engine.generate(prompts, params)
    assert ours_engine.num_steps > 12  # prompts were prefilled in chunks, beside decodes
    reference = engine.with_config(EngineConfig(device="cpu", dtype="float32", attention_backend="torch",
                                                max_num_batched_tokens=256))
    assert reference.runner.attn_fn is paged_attention_ref
    ref = reference.generate(prompts, params)
    assert [o.output_token_ids for o in ours] == [o.output_token_ids for o in ref]
    engine.with_config(engine.config)  # the session's engine back on its own attention function


def test_ninja_is_put_on_path_for_the_build_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys

    from engine.kernels import cpu_kernels

    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)  # no ninja on PATH
    monkeypatch.setenv("PATH", "/nowhere")
    with cpu_kernels._ninja_on_path():
        assert os.environ["PATH"] == os.path.dirname(sys.executable) + os.pathsep + "/nowhere"
    assert os.environ["PATH"] == "/nowhere"
    with pytest.raises(RuntimeError), cpu_kernels._ninja_on_path():  # a failed build leaves PATH as it was too
        raise RuntimeError("build failed")
    assert os.environ["PATH"] == "/nowhere"
