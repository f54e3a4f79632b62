"""Triton fused elementwise ops (engine.kernels.triton_fused) vs the torch path they replace on CUDA.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors. NOTE: triton decides interpreter or
compiled when a kernel is decorated, i.e. when engine.kernels.triton_fused_kernels is first imported, so
TRITON_INTERPRET=1
is set here at module import. Shapes stay tiny (the interpreter runs every program in Python) and odd: hidden sizes
that are not powers of two, T = 1, T and widths that are no multiple of any block.

Tolerances: fp32 matches the torch path to the last bits of fp32 arithmetic, fp16 to one fp16 ulp (an fp32 exp or
rsqrt a bit off torch's can flip a rounding). bf16 gets two bf16 ulps: Triton's interpreter rounds fp32 -> bf16 by
truncation (the GPU rounds to nearest even, as torch does), and an op rounds up to three times.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import torch.nn.functional as F  # noqa: E402
from triton_testing import compile_for_sm90, skip_without_a_backend  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.kernels import triton_fused  # noqa: E402
from engine.kernels.cpu_kernels import cpu_ops  # noqa: E402
from engine.layers.attention import AttentionMetadata, private_kv_cache, write_kv  # noqa: E402
from engine.layers.rms_norm import RMSNorm, fused_ops  # noqa: E402
from engine.layers.rope import apply_rope  # noqa: E402
from engine.model.registry import build_model  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _needs_a_backend() -> None:
    skip_without_a_backend("engine.kernels.triton_fused_kernels", "rms_norm_kernel")


def assert_close(out: torch.Tensor, ref: torch.Tensor, atol: float = 0.0) -> None:
    """out equals ref in shape and dtype, and in value within the dtype's tolerance (module docstring)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=atol + 2 ** -12)
    elif out.dtype == torch.float16:  # one ulp: exp and rsqrt differ from torch's in fp32's last bits
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -10, atol=atol + 2 ** -14)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=atol + 1e-6)


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype=dtype, device=DEVICE)


def torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm's torch path (the CUDA fallback)."""
    return norm._norm(x)


def make_norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 96), (7, 200), (33, 64)])
def test_rms_norm_matches_the_torch_path(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    torch.manual_seed(tokens)
    norm = make_norm(hidden, dtype)
    x = randn(tokens, hidden, dtype=dtype, scale=3.0)
    out = triton_fused.rms_norm(x, norm.weight, norm.eps)
    assert_close(out, torch_norm(norm, x))
    assert out.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reads_strided_rows(dtype: torch.dtype) -> None:
    """A column slice of a wider tensor (rows strided) and a transposed one (columns strided), as the CPU op's
    contract allows strided rows."""
    torch.manual_seed(1)
    norm = make_norm(40, dtype)
    wide = randn(5, 72, dtype=dtype)
    assert_close(triton_fused.rms_norm(wide[:, 8:48], norm.weight, norm.eps), torch_norm(norm, wide[:, 8:48]))
    tall = randn(40, 3, dtype=dtype)
    assert_close(triton_fused.rms_norm(tall.t(), norm.weight, norm.eps), torch_norm(norm, tall.t()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 96), (9, 136)])
def test_add_rms_norm_matches_the_torch_path(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    torch.manual_seed(hidden)
    norm = make_norm(hidden, dtype)
    x, residual = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype, scale=4.0)
    x0, r0 = x.clone(), residual.clone()
    out, total = triton_fused.add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_total = residual + x
    assert_close(total, ref_total)
    assert_close(out, torch_norm(norm, total))  # the norm of the sum it stored (bf16 sums differ by an ulp there)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "inputs must not be written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 40), (5, 1500)])
def test_silu_and_mul_matches_the_torch_path(dtype: torch.dtype, tokens: int, inter: int) -> None:
    """inter 1500: two column blocks of 1024, the second one partial."""
    torch.manual_seed(inter)
    gate_up = randn(tokens, 2 * inter, dtype=dtype, scale=3.0)
    gate, up = gate_up.split(inter, dim=-1)
    out = triton_fused.silu_and_mul(gate_up)
    assert_close(out, F.silu(gate) * up)


def rope_tables(tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] of RoPE at positions 3, 10, 17, ... (base 10000), as engine.layers.rope.RotaryEmbedding
    builds them (head_dim: the rotated dims, R)."""
    positions = torch.arange(tokens).float() * 7 + 3
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions[:, None] * inv_freq[None, :]] * 2, dim=-1)
    return emb.cos().to(dtype=dtype, device=DEVICE), emb.sin().to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
                         [(1, 3, 1, 16, 16), (5, 4, 2, 12, 12), (3, 16, 8, 8, 8), (4, 4, 2, 16, 12), (2, 3, 1, 24, 18)])
def test_rope_write_kv_matches_the_torch_path(dtype: torch.dtype, tokens: int, num_heads: int, num_kv_heads: int,
                                              head_dim: int, rotary_dim: int) -> None:
    """head_dim 12: half of it (6) pads to 8 lanes; 16 + 2 * 8 heads: two programs of 16 heads per token; rotary_dim
    < head_dim: partial rotary (Phi-4-mini's 0.75), the last dims copied (6 of 24 pad to 8 lanes). A slot of -1 (the
    last token when T > 1) writes nothing; every other cache slot keeps what it held."""
    torch.manual_seed(tokens * num_heads)
    h, hkv, d = num_heads, num_kv_heads, head_dim
    qkv = randn(tokens, (h + 2 * hkv) * d, dtype=dtype, scale=2.0)
    cos, sin = rope_tables(tokens, rotary_dim, dtype)
    k_cache, v_cache = randn(3, 4, hkv, d, dtype=dtype), randn(3, 4, hkv, d, dtype=dtype)
    slots = torch.randperm(12)[:tokens]
    if tokens > 1:
        slots[-1] = -1
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = triton_fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, h)
    # The model's torch path (engine.layers.self_attn.Attention.attend): one RoPE for Q and K, then write_kv.
    qk = apply_rope(qkv[:, :(h + hkv) * d].view(tokens, h + hkv, d), cos, sin)
    v = qkv[:, (h + hkv) * d:].view(tokens, hkv, d)
    kept = slots >= 0
    write_kv(qk[kept, h:], v[kept], k_ref, v_ref, slots[kept])
    assert_close(q, qk[:, :h].contiguous(), atol=2 ** -6 if dtype == torch.bfloat16 else 0.0)
    assert_close(k_cache, k_ref, atol=2 ** -6 if dtype == torch.bfloat16 else 0.0)
    assert torch.equal(v_cache, v_ref), "V is a copy: bit-exact"


def test_inputs_the_kernels_do_not_serve_are_errors() -> None:
    x = torch.zeros(2, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="dtype torch.float64 not served"):
        triton_fused.rms_norm(x, torch.ones(8, dtype=torch.float64, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be contiguous \[8\]"):
        triton_fused.rms_norm(x.float(), torch.ones(6, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="width 7 is odd"):
        triton_fused.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    k_cache = torch.zeros(2, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"qkv must be \[T, \(num_heads"):
        triton_fused.rope_write_kv(torch.zeros(2, 40, device=DEVICE), torch.zeros(2, 8, device=DEVICE),
                                   torch.zeros(2, 8, device=DEVICE), k_cache, k_cache.clone(),
                                   torch.zeros(2, dtype=torch.int64, device=DEVICE), 2)
    with pytest.raises(ValueError, match="slot_mapping dtype torch.int32"):
        triton_fused.rope_write_kv(torch.zeros(2, 32, device=DEVICE), torch.zeros(2, 8, device=DEVICE),
                                   torch.zeros(2, 8, device=DEVICE), k_cache, k_cache.clone(),
                                   torch.zeros(2, dtype=torch.int32, device=DEVICE), 2)


def test_the_dispatcher_keeps_the_cpu_path_and_switches_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 8)
    with torch.no_grad():
        assert fused_ops(x) is cpu_ops()
        assert fused_ops(x.to("meta")) is None
    assert fused_ops(x) is None, "autograd on: the torch path (GPTQ tuning trains through the norms)"
    triton_fused.triton_fused_ops.cache_clear()
    try:
        monkeypatch.setenv("TOKENMILL_TRITON_FUSED", "0")
        assert triton_fused.triton_fused_ops() is None
        triton_fused.triton_fused_ops.cache_clear()
        monkeypatch.delenv("TOKENMILL_TRITON_FUSED")
        assert triton_fused.triton_fused_ops() is triton_fused
    finally:
        triton_fused.triton_fused_ops.cache_clear()


def tiny_config(rotary_dim: int | None = None) -> ModelConfig:
    """Two layers, hidden 48 (not a power of two), GQA 3/1 heads of 16, SwiGLU width 80."""
    return ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=3,
                       num_kv_heads=1, head_dim=16, rotary_dim=rotary_dim)


@pytest.mark.parametrize(("dtype", "rotary_dim"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 12)])
def test_the_model_with_the_triton_ops_equals_its_torch_path(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                             rotary_dim: int | None) -> None:
    """The call sites (engine/layers/self_attn.py, mlp.py, rms_norm.py) hand their tensors to the Triton ops as they
    do to the C++ ones: a fused-projection model's hidden states and KV cache after one prefill equal the torch
    path's, with full and partial rotary (12 of 16 dims)."""
    import engine.layers.mlp
    import engine.layers.rms_norm
    import engine.layers.self_attn

    cfg = tiny_config(rotary_dim)
    torch.manual_seed(0)
    model = build_model(cfg, 64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model = model.to(device=DEVICE, dtype=dtype)
    model.materialize_rotary(torch.device(DEVICE))
    assert model.fuse_projections() == 2 * cfg.num_layers
    tokens = 11
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=DEVICE)
    positions = torch.arange(tokens, device=DEVICE)
    calls: list[str] = []

    def run(ops: object) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        monkeypatch.setattr(engine.layers.self_attn, "fused_ops", lambda x: ops)
        monkeypatch.setattr(engine.layers.mlp, "fused_ops", lambda x: ops)
        monkeypatch.setattr(engine.layers.rms_norm, "fused_ops", lambda x: ops)
        caches = [private_kv_cache(tokens, 4, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device(DEVICE))
                  for _ in range(cfg.num_layers)]
        meta = AttentionMetadata.single_prefill(tokens, 4, torch.device(DEVICE))
        with torch.inference_mode():
            return model(ids, positions, caches, meta), caches

    class Spy:
        def __getattr__(self, name: str) -> object:
            calls.append(name)
            return getattr(triton_fused, name)

    fused, fused_caches = run(Spy())
    ref, ref_caches = run(None)
    # per layer: the input norm, RoPE + KV write, the add + post-attention norm, silu_and_mul; then the final norm
    assert calls == ["rms_norm", "rope_write_kv", "add_rms_norm", "silu_and_mul"] * cfg.num_layers + ["rms_norm"]
    atol = 0.1 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused.float(), ref.float(), rtol=0.05 if dtype == torch.bfloat16 else 1e-5,
                               atol=atol)
    for (k, v), (k_ref, v_ref) in zip(fused_caches, ref_caches, strict=True):
        torch.testing.assert_close(k.float(), k_ref.float(), rtol=0.05 if dtype == torch.bfloat16 else 1e-5,
                                   atol=atol)
        torch.testing.assert_close(v.float(), v_ref.float(), rtol=0.05 if dtype == torch.bfloat16 else 1e-5,
                                   atol=atol)


@pytest.mark.gpu
def test_engine_greedy_is_token_identical_with_and_without_the_fused_ops(
        gguf_path: str, gsm8k_questions: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The real SmolLM2 GGUF on CUDA in fp32 (CUDA graphs on): greedy output with the Triton fused ops equals the
    torch path's (TOKENMILL_TRITON_FUSED=0), token for token."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set: the engine on CUDA needs compiled kernels")
    prompts, params = gsm8k_questions[:16], SamplingParams(max_tokens=32)
    outputs = {}
    try:
        for switch in ("0", "1"):
            monkeypatch.setenv("TOKENMILL_TRITON_FUSED", switch)
            triton_fused.triton_fused_ops.cache_clear()
            with torch.no_grad():
                assert (fused_ops(torch.zeros(1, device="cuda")) is triton_fused) == (switch == "1")
            eng = LLMEngine.from_model(gguf_path, EngineConfig(device="cuda", dtype="float32", max_num_seqs=16))
            outputs[switch] = [o.output_token_ids for o in eng.generate(prompts, params)]
            assert eng.runner.graphs is not None and eng.runner.graphs.graphs
            del eng
    finally:
        triton_fused.triton_fused_ops.cache_clear()
    assert outputs["1"] == outputs["0"]


# Compiles every kernel for sm_90 in a fresh process (no TRITON_INTERPRET), as test_triton_attention.py does: the
# interpreter checks no types or constexpr use, the compiler does; triton ships ptxas, so no GPU is needed. The
# shapes are the Llama-3.1-8B ones (hidden 4096, head_dim 128) and a head norm's (hidden 128); a stride of 1 is
# specialized to a constexpr at launch, so both forms compile.
_COMPILE_SCRIPT = """
from engine.kernels import triton_fused_kernels as K

for dt in ("bf16", "fp32"):
    ptrs = {p: "*" + dt for p in ("x_ptr", "residual_ptr", "sum_ptr", "weight_ptr", "out_ptr", "gate_up_ptr",
                                  "qkv_ptr", "cos_ptr", "sin_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    ptrs.update(slot_ptr="*i64", eps="fp32")
    for residual in (False, True):
        compile_kernel(K.rms_norm_kernel, ptrs, dict(HAS_RESIDUAL=residual, BLOCK=4096), num_warps=8)
        compile_kernel(K.rms_norm_kernel, ptrs, dict(HAS_RESIDUAL=residual, BLOCK=128, stride_xc=1), num_warps=1)
    compile_kernel(K.silu_and_mul_kernel, ptrs, dict(BLOCK=1024, stride_c=1))
    compile_kernel(K.silu_and_mul_kernel, ptrs, dict(BLOCK=64))
    compile_kernel(K.rope_write_kv_kernel, ptrs, dict(HEAD_DIM=128, ROT_DIM=128, HALF_PAD=64, PASS_PAD=1, BLOCK_H=16))
    compile_kernel(K.rope_write_kv_kernel, ptrs, dict(HEAD_DIM=80, ROT_DIM=80, HALF_PAD=64, PASS_PAD=1, BLOCK_H=16))
    # partial rotary, Phi-4-mini's head: 72 of 96 dims rotate
    compile_kernel(K.rope_write_kv_kernel, ptrs, dict(HEAD_DIM=96, ROT_DIM=72, HALF_PAD=64, PASS_PAD=32, BLOCK_H=16))
print("compiled")
"""


def test_kernels_compile_for_sm90() -> None:
    compile_for_sm90("triton_fused", _COMPILE_SCRIPT, {"num_warps": 4})
