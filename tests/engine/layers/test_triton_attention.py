"""Triton paged attention kernels vs the torch reference `paged_attention_ref`.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors. NOTE: triton decides interpreter or
compiled when a kernel is decorated, i.e. when engine.kernels.triton_attention_kernels is first imported, so
TRITON_INTERPRET=1 is set here at module import, before anything below imports it. Sizes stay small: the interpreter
runs every program in Python.
"""

from __future__ import annotations

import logging
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

import attention_steps  # noqa: E402
from triton_testing import compile_for_sm90, skip_without_a_backend  # noqa: E402

from engine.layers.attention import AttentionMetadata, paged_attention_ref  # noqa: E402
from engine.layers.triton_attention import (  # noqa: E402
    decode_num_splits,
    paged_attention_triton,
    paged_decode_attention,
    paged_prefill_attention,
    triton_available,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
HEAD_DIM = attention_steps.HEAD_DIM
# Max abs error vs the reference per dtype: fp32 runs IEEE dots; half precision rounds P to 16 bits before P @ V.
ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _needs_a_backend() -> None:
    skip_without_a_backend("engine.kernels.triton_attention_kernels", "paged_decode_kernel")


def make_step(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, block_size: int,
              dtype: torch.dtype, device: str = DEVICE, **kwargs: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """attention_steps.make_step on this module's device (the GPU, or the CPU under the interpreter)."""
    return attention_steps.make_step(query_lens, seq_lens, num_heads, num_kv_heads, block_size, dtype, device,
                                     **kwargs)


def max_err(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float) -> float:
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    return (out.float() - ref.float()).abs().max().item()


def test_triton_available() -> None:
    assert triton_available()


def test_a_missing_triton_on_cuda_is_a_loud_warning_and_a_broken_one_an_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import builtins

    import engine.layers.triton_attention as ta

    real_import = builtins.__import__
    failure: list[BaseException] = [ImportError("No module named 'triton'")]

    def fake_import(name: str, *args: object, **kwargs: object) -> object:
        if name == "triton":
            raise failure[0]
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ta._warn_no_triton.cache_clear()
    with caplog.at_level(logging.WARNING, logger="engine.layers.triton_attention"):
        assert not ta.triton_available()
    assert any("triton does not import (ImportError" in r.getMessage() and "torch reference" in r.getMessage()
               for r in caplog.records)
    failure[0] = OSError("libcuda.so.1: cannot open shared object file")  # a broken install is no "absent"
    with pytest.raises(OSError, match="libcuda"):
        ta.triton_available()


# Decode: contexts of 1 token, under one page, and spanning several pages, none a multiple of the page size.
DECODE_SEQ_LENS = [1, 13, 37, 70]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp32(group: int, block_size: int, num_splits: int) -> None:
    q, kc, vc, meta = make_step([1] * 4, DECODE_SEQ_LENS, 2 * group, 2, block_size, torch.float32)
    scale = HEAD_DIM ** -0.5
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, num_splits=num_splits,
                                 block_n=16)
    assert max_err(out, q, kc, vc, meta, scale) < ATOL[torch.float32]


# Prefill batches mix a full prefill (q_len == seq_len), chunked prefills (q_len < seq_len) and a decode row.
PREFILL_QUERY_LENS = [21, 5, 1, 40]
PREFILL_SEQ_LENS = [21, 30, 19, 67]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_fp32(group: int, block_size: int) -> None:
    q, kc, vc, meta = make_step(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 2 * group, 2, block_size, torch.float32)
    scale = HEAD_DIM ** -0.5
    # block_m 16 with group 3: 5 tokens per tile, so requests span several query tiles.
    out = paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                                  block_m=16, block_n=16)
    assert max_err(out, q, kc, vc, meta, scale) < ATOL[torch.float32]


def test_prefill_single_full_prompt_default_tiles() -> None:
    q, kc, vc, meta = make_step([45], [45], 4, 4, 16, torch.float32)
    out = paged_attention_triton(q, kc, vc, meta, 0.1)
    assert max_err(out, q, kc, vc, meta, 0.1) < ATOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    scale = HEAD_DIM ** -0.5
    q, kc, vc, meta = make_step([1] * 4, DECODE_SEQ_LENS, 6, 2, 16, dtype)
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, num_splits=2, block_n=16)
    assert max_err(out, q, kc, vc, meta, scale) < ATOL[dtype]
    q, kc, vc, meta = make_step(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 6, 2, 16, dtype)
    out = paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                                  block_m=16, block_n=16)
    assert max_err(out, q, kc, vc, meta, scale) < ATOL[dtype]


def test_entry_point_dispatch_and_padded_tables() -> None:
    """Decode-only and mixed steps through `paged_attention_triton`, block tables padded wider than needed."""
    for query_lens, seq_lens in (([1, 1, 1], [9, 40, 17]), ([1, 12, 1], [9, 40, 17])):
        q, kc, vc, meta = make_step(query_lens, seq_lens, 6, 2, 16, torch.float32, extra_table_cols=2)
        out = paged_attention_triton(q, kc, vc, meta, 0.125)
        assert max_err(out, q, kc, vc, meta, 0.125) < ATOL[torch.float32]


def test_strided_q() -> None:
    """q as a view of a fused projection (non-contiguous rows), as the model may hand it over."""
    for query_lens in ([1, 1], [1, 3]):
        q, kc, vc, meta = make_step(query_lens, [11, 20], 6, 2, 16, torch.float32)
        q_view = torch.cat([q, torch.zeros_like(q)], dim=1)[:, :6]  # [T, 2H, D] -> the first H heads
        assert not q_view.is_contiguous()
        out = paged_attention_triton(q_view, kc, vc, meta, 0.125)
        assert max_err(out, q, kc, vc, meta, 0.125) < ATOL[torch.float32]


def test_chunked_prefill_matches_full_prefill() -> None:
    """A prompt prefilled in two chunks gives the same rows as in one step."""
    q, kc, vc, meta = make_step([30], [30], 6, 2, 8, torch.float32)
    full = paged_attention_triton(q, kc, vc, meta, 0.125)
    meta.query_start_loc = torch.tensor([0, 12], dtype=torch.int32, device=q.device)
    meta.seq_lens = torch.tensor([12], dtype=torch.int32, device=q.device)
    first = paged_attention_triton(q[:12], kc, vc, meta, 0.125)
    meta.query_start_loc = torch.tensor([0, 18], dtype=torch.int32, device=q.device)
    meta.seq_lens = torch.tensor([30], dtype=torch.int32, device=q.device)
    second = paged_attention_triton(q[12:], kc, vc, meta, 0.125)
    torch.testing.assert_close(torch.cat([first, second]), full, atol=1e-5, rtol=1e-5)


WINDOWS = [1, 5, 16, 37, 1000]  # one key; under, at and over a 16-key page/tile; longer than every context
# The kernel settings each window runs with: (GQA group, page size) and, for decode, the split count. Each window
# runs two settings that differ in every one of them, and over the windows every two settings meet in all four
# combinations (a pairwise covering): each branch of the window masks runs beside each page size, GQA group and
# split count, at half the interpreter time of the full product (which repeats the same pairs).
_PREFILL_PAIRS = [((1, 8), (3, 16)), ((1, 16), (3, 8))]
PREFILL_WINDOW_CASES = [(w, *case) for i, w in enumerate(WINDOWS) for case in _PREFILL_PAIRS[i % 2]]
_DECODE_PAIRS = [((1, 8, 1), (3, 16, 3)), ((1, 16, 1), (3, 8, 3)), ((1, 8, 3), (3, 16, 1)), ((1, 16, 3), (3, 8, 1))]
DECODE_WINDOW_CASES = [(w, *case) for i, w in enumerate(WINDOWS) for case in _DECODE_PAIRS[i % 4]]


def test_window_cases_cover_every_pair() -> None:
    """Every window meets both values of each setting; every two settings meet in all their combinations."""
    for cases, names in ((PREFILL_WINDOW_CASES, ("group", "page")), (DECODE_WINDOW_CASES, ("group", "page", "split"))):
        assert {c[0] for c in cases} == set(WINDOWS)
        for i in range(1, len(names) + 1):
            values = {c[i] for c in cases}
            assert len(values) == 2 and all({(c[0], c[i]) for c in cases} >= {(w, v) for v in values}
                                            for w in WINDOWS), names[i - 1]
            for j in range(i + 1, len(names) + 1):
                assert len({(c[i], c[j]) for c in cases}) == 4, (names[i - 1], names[j - 1])


@pytest.mark.parametrize("window, group, block_size, num_splits", DECODE_WINDOW_CASES)
def test_decode_sliding_window(window: int, group: int, block_size: int, num_splits: int) -> None:
    # Against the dense masked oracle; then blocks wholly before each window are NaN and must not be read.
    q, kc, vc, meta = make_step([1] * 4, DECODE_SEQ_LENS, 2 * group, 2, block_size, torch.float32)
    oracle = attention_steps.dense_attention(q, kc, vc, meta, 0.125, window)
    attention_steps.poison_outside_windows(kc, vc, meta, window)
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, num_splits=num_splits,
                                 block_n=16, sliding_window=window)
    assert (out - oracle).abs().max().item() < ATOL[torch.float32]


@pytest.mark.parametrize("window, group, block_size", PREFILL_WINDOW_CASES)
def test_prefill_sliding_window(window: int, group: int, block_size: int) -> None:
    # block_m 16 with group 3: 5 tokens per query tile, so a tile's rows start their windows in different key tiles
    # and some rows see no key of the first tile the program reads.
    q, kc, vc, meta = make_step(PREFILL_QUERY_LENS, PREFILL_SEQ_LENS, 2 * group, 2, block_size, torch.float32)
    oracle = attention_steps.dense_attention(q, kc, vc, meta, 0.125, window)
    attention_steps.poison_outside_windows(kc, vc, meta, window)
    out = paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125,
                                  block_m=16, block_n=16, sliding_window=window)
    assert (out - oracle).abs().max().item() < ATOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sliding_window_half_precision_default_tiles(dtype: torch.dtype) -> None:
    for query_lens, seq_lens in (([1] * 4, DECODE_SEQ_LENS), ([1, 130, 7], [200, 130, 90])):
        q, kc, vc, meta = make_step(query_lens, seq_lens, 6, 2, 16, dtype, extra_table_cols=2)
        out = paged_attention_triton(q, kc, vc, meta, 0.125, sliding_window=21)
        oracle = attention_steps.dense_attention(q, kc, vc, meta, 0.125, 21)
        assert (out.float() - oracle.float()).abs().max().item() < ATOL[dtype]
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_triton(q, kc, vc, meta, 0.125, sliding_window=0)


def test_decode_num_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.layers.triton_attention as ta

    monkeypatch.setattr(ta, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert decode_num_splits(64, 8, 128, 16, cuda) == 1  # 512 programs fill 132 SMs
    assert decode_num_splits(1, 8, 128, 16, cuda) == 8  # 2048 tokens = 32 tiles of 64, at least 4 per split
    assert decode_num_splits(1, 8, 1024, 16, cuda) == 32  # capped at MAX_SPLITS
    assert decode_num_splits(4, 8, 2, 16, cuda) == 1  # a 32-token context is one tile
    assert decode_num_splits(1, 8, 128, 16, torch.device("cpu")) == 1


def test_bad_inputs_raise_value_error() -> None:
    q, kc, vc, meta = make_step([1, 1], [5, 9], 6, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_triton(q[:, :5], kc, vc, meta, 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_triton(q[..., :32], kc, vc, meta, 0.125)
    with pytest.raises(ValueError, match="block_n"):
        paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, block_n=24)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(q.double(), kc, vc, meta, 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_llama_shape_bf16_on_cuda(num_splits: int | None) -> None:
    """Llama-3.1-8B head shape (32 q heads, 8 KV heads, head_dim 128), bf16, compiled kernels on the GPU."""
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set: the kernels would not run compiled")
    seq_lens = [1, 100, 517, 1999, 64, 300]
    q, kc, vc, meta = make_step([1] * 6, seq_lens, 32, 8, 16, torch.bfloat16, device="cuda", head_dim=128)
    scale = 128 ** -0.5
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, num_splits=num_splits)
    assert max_err(out, q, kc, vc, meta, scale) < ATOL[torch.bfloat16]
    q, kc, vc, meta = make_step([300, 1, 77, 1000], [300, 517, 600, 1999], 32, 8, 16, torch.bfloat16,
                                device="cuda", head_dim=128)
    out = paged_attention_triton(q, kc, vc, meta, scale)
    assert max_err(out, q, kc, vc, meta, scale) < ATOL[torch.bfloat16]
    q, kc, vc, meta = make_step([1, 40], [50, 40], 8, 2, 16, torch.float32, device="cuda")
    out = paged_attention_triton(q, kc, vc, meta, 0.125)
    assert max_err(out, q, kc, vc, meta, 0.125) < 1e-4


# Compiles every kernel for sm_90 in a fresh process (no TRITON_INTERPRET): the interpreter does not check types,
# loop-carried values, tl.dot shapes or shared memory, the compiler does, and triton ships ptxas, so no GPU is needed.
_COMPILE_SCRIPT = """
from engine.kernels import triton_attention_kernels as K

for dt in ("bf16", "fp32"):
    ptrs = {p: "*" + dt for p in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    ptrs.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", part_acc_ptr="*fp32",
                part_m_ptr="*fp32", part_l_ptr="*fp32", scale_log2e="fp32", softcap_log2e="fp32")
    common = dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_D=128, BLOCK_N=64, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                  BF16_WORKAROUND=False, USE_WINDOW=False, SOFTCAP=False)
    for splits in (1, 4):
        compile_kernel(K.paged_decode_kernel, ptrs, dict(common, GROUP=4, BLOCK_H=16, NUM_SPLITS=splits))
    compile_kernel(K.paged_decode_reduce_kernel, ptrs, dict(HEAD_DIM=128, NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=128))
    # num_requests == 1 is specialized to a constexpr at launch: the binary search must still compile.
    for extra in ({}, {"num_requests": 1}):
        compile_kernel(K.paged_prefill_kernel, ptrs, dict(common, GROUP=3, BLOCK_M=64, BLOCK_Q=21, **extra))
    if dt == "bf16":  # the sliding-window variants (Mistral): split-K decode and the prefill kernel
        compile_kernel(K.paged_decode_kernel, ptrs, dict(common, GROUP=4, BLOCK_H=16, NUM_SPLITS=4, USE_WINDOW=True))
        compile_kernel(K.paged_prefill_kernel, ptrs, dict(common, GROUP=3, BLOCK_M=64, BLOCK_Q=21, USE_WINDOW=True))
        for window in (False, True):  # soft-capped (Gemma 2's global and sliding layers)
            capped = dict(common, USE_WINDOW=window, SOFTCAP=True)
            compile_kernel(K.paged_decode_kernel, ptrs, dict(capped, GROUP=4, BLOCK_H=16, NUM_SPLITS=4))
            compile_kernel(K.paged_prefill_kernel, ptrs, dict(capped, GROUP=3, BLOCK_M=64, BLOCK_Q=21))
print("compiled")
"""


def test_kernels_compile_for_sm90() -> None:
    compile_for_sm90("triton_attention", _COMPILE_SCRIPT, {"num_warps": 4, "num_stages": 2},
                     {"TRITON_DEFAULT_FP_FUSION": "1"})


def test_engine_on_the_triton_backend_matches_the_torch_backend(gguf_path: str, gsm8k_questions: list[str]) -> None:
    # The whole engine (chunked prefill, mixed prefill/decode steps, decode, preemption-free) on the Triton kernels:
    # a 2-layer random model with the real tokenizer and real prompts keeps the interpreter fast enough.
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.text.tokenizer import Tokenizer

    prompts = gsm8k_questions[40:42]
    tokenizer = Tokenizer.from_gguf(gguf_path)
    outs = {}
    for backend in ("torch", "triton"):
        cfg = EngineConfig(device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=48,
                           attention_backend=backend, enforce_eager=True)
        tiny = LLMEngine.from_config("tiny", cfg, tokenizer=tokenizer, seed=3)
        assert tiny.runner.attn_fn.__name__ == f"paged_attention_{'ref' if backend == 'torch' else 'triton'}"
        outs[backend] = tiny.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(o.num_prompt_tokens > 48 for o in outs["torch"])  # every prompt was prefilled in chunks
    assert [o.output_token_ids for o in outs["triton"]] == [o.output_token_ids for o in outs["torch"]]


def test_tiny_mistral_on_the_triton_backend_matches_hf(gguf_path: str, gsm8k_questions: list[str]) -> None:
    # The sliding window through the whole engine on the Triton kernels (chunked prefill: chunks of 40 tokens,
    # longer than the 24-token window; decode), greedy tokens against HF transformers' MistralForCausalLM. Fewer
    # prompts and tokens than test_sliding_window.py's parity test: the interpreter runs every program in Python, so
    # 2 prompts (the second's chunks beside the first's last chunk and decodes) keep it to half the programs of 4.
    pytest.importorskip("transformers")
    from tiny_mistral import build_hf_mistral, mismatches, our_engine

    from engine import EngineConfig, SamplingParams
    from engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(gguf_path)
    hf = build_hf_mistral(49152, 1, tokenizer.eos_token_id)
    cfg = EngineConfig(device=DEVICE, dtype="float32", block_size=8, max_num_batched_tokens=40,
                       attention_backend="triton", enforce_eager=True)
    engine = our_engine(hf, tokenizer, cfg)
    assert engine.runner.attn_fn is paged_attention_triton
    outs = engine.generate(gsm8k_questions[:2], SamplingParams(max_tokens=12, temperature=0.0))
    assert not mismatches(outs, hf, 1)
