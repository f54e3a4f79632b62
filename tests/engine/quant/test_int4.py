"""INT4 weight-only quantization: packing, Int4Linear against a dequantized reference, GGUF Q4 loaded natively,
model folders (quantize -> save -> load -> generate), folder sizes and perplexity on real text. The calibrated path
(GPTQ, refit, end-to-end tuning) is in test_int4_calibration.py: a file of its own, so that pytest-xdist's
`--dist loadfile` can run the two halves on two workers."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from engine.loading.gguf_int4 import gguf_q4_to_int4
from engine.loading.open_model import open_model
from engine.loading.tokenmill_folder import folder_bytes, read_folder
from engine.model.perplexity import perplexity, text_token_ids
from engine.model.sequence_forward import forward_sequence
from engine.ptq.quantize import quantize_model
from engine.ptq.to_folder import quantize_to_folder
from engine.quant.int4_linear import Int4Linear, release_int4_sources
from engine.quant.qparams import Int4Weight, pack_uint4, quantize_int4, unpack_uint4

CPU = torch.device("cpu")
# One forward of a 512-token chunk (half of perplexity()'s 1,024: the three scorings at 1,024 cost 7 CPU-s more);
# the full-sample figures are in bench/README.md. Measured (AVX512 and AVX2 alike): base 6.759, g32 -0.05% (the
# gate: 1%; -0.15% on the first 1,024 tokens and +0.07% on the next 1,024: far inside it either way, as g32
# round-to-nearest barely moves the weights), g128 +98% here (+87% on 1,024; +51% / +72% on 20k tokens).
PPL_TOKENS = 512


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one sequence from an empty private KV cache in the model's dtype."""
    with torch.inference_mode():
        return model.compute_logits(forward_sequence(model, torch.tensor(ids)))


@pytest.fixture(scope="module")
def reference_ids(ref, data_dir) -> list[int]:
    """The first PPL_TOKENS token ids of the AlpacaEval reference answers joined. The first 20 answers hold 11.7k
    tokens and the byte-level BPE tokenizer splits at whitespace, so their ids are those of all 805 joined
    (checked), without tokenizing the 357k tokens of the whole column (1 CPU-s)."""
    texts = pq.read_table(data_dir / "alpaca_eval.parquet", columns=["reference_output"]).column(0).to_pylist()
    return text_token_ids(ref.tokenizer, texts[:20], PPL_TOKENS)


def test_pack_unpack_round_trip() -> None:
    q = torch.randint(0, 16, (24, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_uint4(q)
    assert packed.shape == (24, 48) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == (int(q[0, 0]) << 4) | int(q[0, 1])  # element 2j in the high nibble
    assert torch.equal(unpack_uint4(packed), q)


@pytest.mark.parametrize("k, group_size", [(576, 32), (576, 128), (1536, 64)])
def test_quantize_round_trip_and_padding(k: int, group_size: int) -> None:
    w = torch.randn(64, k, generator=torch.Generator().manual_seed(1)) * 0.02
    q = quantize_int4(w, group_size)
    assert q.padded_in_features % group_size == 0 and q.scales.dtype == torch.bfloat16
    rel = ((q.dequantize() - w).norm() / w.norm()).item()
    assert rel < 0.1  # 4-bit grid on Gaussian weights: ~7-9% relative RMS error
    grid = quantize_int4(w, group_size, method="minmax").dequantize()
    again = quantize_int4(grid, group_size, method="minmax")  # values already on a min-max grid stay there
    assert ((again.dequantize() - grid).norm() / w.norm()).item() < 0.01


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_int4_linear_matches_dequantized_reference(dtype: torch.dtype, tol: float) -> None:
    """fp32 runs dequantize-then-GEMM (measured relative error 0.0); bf16 runs the CPU tinygemm kernel
    `_weight_int4pack_mm_for_cpu` (measured 1.6e-3 relative, the bf16 rounding of activations and output)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(192, 576, generator=gen) * 0.02
    q = quantize_int4(w, 128)  # K=576 is padded to 640 for group 128
    lin = Int4Linear(q, dtype, CPU)
    assert lin.kernel_for(7) == ("dequant" if dtype == torch.float32 else "tinygemm")
    x = torch.randn(3, 7, 576, generator=gen)
    y = lin(x.to(dtype))
    ref = x @ q.dequantize().t()
    assert y.shape == (3, 7, 192) and y.dtype == dtype
    assert ((y.float() - ref).norm() / ref.norm()).item() < tol


def test_gguf_q4_blocks_map_exactly() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    x = np.random.default_rng(3).standard_normal((16, 128)).astype(np.float32)
    for qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        raw = quantize(x, qtype)
        w = gguf_q4_to_int4(raw, qtype.name, (16, 128))
        assert w.group_size == 32
        np.testing.assert_array_equal(w.dequantize().numpy(), dequantize(raw, qtype))
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q4_K"):
        gguf_q4_to_int4(raw, "Q8_0", (16, 128))


def test_gguf_q4_k_maps_to_group_32_int4() -> None:
    """A Q4_K super-block is eight 32-weight groups w = (d sc) q - dmin m: the same integers at scale d sc, zero
    8 d sc - dmin m (engine.loading.gguf_int4). Equal to gguf-py's weights wherever that zero is exact in fp32
    (checked in float64: every group with |zero| < 1, as in trained models); elsewhere the zero's one rounding moves
    a weight by about one ulp of the zero."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf_models import random_tensor

    n, k = 96, 1024
    raw = random_tensor(GGMLQuantizationType.Q4_K, n, k, 0.1, np.random.default_rng(4))
    big = raw.reshape(-1, 144)[::4]  # every fourth super-block: weights up to about +-30 and tiny mins, so zeros
    big[:, 0:2] = np.full(len(big), 0.06, np.float16).view(np.uint8).reshape(-1, 2)  # of 5 + 24 bits fp32 rounds
    big[:, 2:4] = np.full(len(big), 3e-7, np.float16).view(np.uint8).reshape(-1, 2)
    w = gguf_q4_to_int4(raw, "Q4_K", (n, k))
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K))
    got = w.dequantize()
    assert w.group_size == 32 and got.shape == want.shape == (n, k)
    from gguf.quants import Q4_K

    sb = raw.reshape(-1, 144)
    d = sb[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = sb[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, m = Q4_K.get_scale_min(sb[:, 4:16])
    exact_zero = torch.from_numpy((8 * d * sc - dmin * m).reshape(n, k // 32)) == w.zeros.double()
    exact = exact_zero.repeat_interleave(32, dim=1)
    assert 0.5 < exact.float().mean().item() < 1  # both cases occur
    small = w.zeros.abs().repeat_interleave(32, dim=1) < 1
    assert exact[small].all()
    assert torch.equal(got[exact], want[exact])  # as numbers: gguf-py's -0 (d < 0, q = 0, m = 0) is +0 here
    # elsewhere: half an ulp of the zero, plus the two results' own roundings of nearby numbers
    bound = torch.finfo(torch.float32).eps * (w.zeros.abs().repeat_interleave(32, dim=1) + want.abs())
    assert ((got - want).abs() <= bound).all()


@pytest.fixture(scope="module")
def native(gguf_path: str):
    """The real model loaded with its GGUF Q4_1 projections as Int4Linear (fp32, CPU), once per module. Read-only:
    a test that changes it deep-copies `native.model` first."""
    return open_model(gguf_path, torch.float32, CPU, quantization="auto", tokenizer=False)  # ref's tokenizer serves


def test_gguf_q4_1_native_logits_match_dequantized(gguf_path: str, ref, native, alpaca_instructions) -> None:
    assert native.num_int4_modules == 30 * 7  # every projection of SmolLM2-135M is Q4_1
    assert isinstance(native.model.layers[0].self_attn.q_proj, Int4Linear)
    ref_logits = []
    for prompt in alpaca_instructions[:2]:
        ids = ref.tokenizer.encode(prompt)
        a, b = _logits(ref.model, ids), _logits(native.model, ids)
        assert ((a - b).norm() / a.norm()).item() < 1e-3
        ref_logits.append(a)
    # bf16 through the tinygemm CPU kernel: same argmax on most positions (bf16 activations).
    bf = open_model(gguf_path, torch.bfloat16, CPU, quantization="auto", tokenizer=False)
    ids = ref.tokenizer.encode(alpaca_instructions[0])
    agree = (_logits(bf.model, ids).argmax(-1) == ref_logits[0].argmax(-1)).float().mean().item()
    assert agree > 0.8


def _greedy(model: torch.nn.Module, ids: list[int], n: int, logits: torch.Tensor) -> list[int]:
    """n greedy tokens after `ids`, each from a full forward of the sequence so far; `logits`: the model's logits of
    `ids` (already computed), whose last row gives the first token."""
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        out.append(int(_logits(model, ids + out)[-1].argmax()))
    return out


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_fused_projections_give_the_same_greedy_tokens(ref, native, alpaca_instructions, quantization: str) -> None:
    """The serving layout (one QKV and one gate/up GEMM per layer, plain fp32 and INT4 Q4_1) computes what the
    file's separate projections compute: logits within fp32 rounding on two real prompts, the same 6 greedy tokens
    after the first (each greedy token is a full forward of both models: most of this test's CPU time)."""
    unfused = ref if quantization == "none" else native
    fused = copy.deepcopy(unfused.model)
    assert fused.fuse_projections() == 2 * unfused.config.num_layers
    assert fused.fuse_projections() == 0  # idempotent
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    kind = torch.nn.Linear if quantization == "none" else Int4Linear
    assert isinstance(attn.qkv_proj, kind) and isinstance(mlp.gate_up_proj, kind)
    if kind is Int4Linear:  # the joined portable weight stays where the parts' were; released, it cannot fuse again
        assert attn.qkv_proj.source.qweight.device == attn.qkv_proj.source.scales.device == CPU
        assert release_int4_sources(copy.deepcopy(fused)) == 4 * unfused.config.num_layers
        head = copy.deepcopy(attn.qkv_proj)
        head.release_source()
        assert Int4Linear.concat([head, attn.qkv_proj]) is None
    assert attn.qkv_proj.out_features == (unfused.config.num_heads + 2 * unfused.config.num_kv_heads) * 64
    for i, prompt in enumerate(alpaca_instructions[:2]):
        ids = ref.tokenizer.encode(prompt)
        a, b = _logits(unfused.model, ids), _logits(fused, ids)
        assert ((a - b).norm() / a.norm()).item() < 1e-5
        if i == 0:
            assert _greedy(fused, ids, 6, b) == _greedy(unfused.model, ids, 6, a)


@pytest.fixture(scope="module")
def int4_g128(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(folder, its JSON config) of `quantize_to_folder(GGUF, bits=4, group_size=128)` (round-to-nearest, the
    embedding INT4 too: what `tokenmill quantize` writes by default), written once per module: about 6 CPU-s.
    Read-only."""
    out = tmp_path_factory.mktemp("int4-g128") / "int4"
    return out, quantize_to_folder(gguf_path, str(out), bits=4, group_size=128)


def test_quantize_save_load_generate(gguf_path: str, int4_g128: tuple[Path, dict], tmp_path) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams

    (int4_dir, meta), bf16_dir = int4_g128, tmp_path / "bf16"
    quantize_to_folder(gguf_path, str(bf16_dir), bits=16)
    assert meta["quantization"]["group_size"] == 128 and "embed_tokens" in meta["quantization"]["modules"]
    ratio = folder_bytes(str(int4_dir)) / folder_bytes(str(bf16_dir))
    assert ratio <= 0.35, f"INT4 folder is {ratio:.3f}x the bf16 folder"
    _, state, _ = read_folder(str(int4_dir))
    assert isinstance(state["layers.0.self_attn.q_proj"], Int4Weight)
    assert state["layers.0.self_attn.q_proj"].qweight.shape == (576, 640 // 2)
    config = EngineConfig(device="cpu", dtype="bfloat16", quantization="auto", num_kv_blocks=64)
    engine = LLMEngine.from_model(str(int4_dir), config)
    assert engine.model_name == "int4"
    int4 = [m for m in engine.runner.model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 30 * 4 + 1 and all(m.source is None for m in int4)  # fused, then the portable copies freed
    out = engine.generate(["What is the capital of France?"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.finish_reason in ("stop", "length") and out.output_token_ids and out.text.strip()
    plain = LLMEngine.from_model(str(bf16_dir), EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64))
    assert plain.generate(["Hi"], SamplingParams(max_tokens=2))[0].output_token_ids


@pytest.fixture(scope="module")
def base_perplexity(ref, reference_ids) -> float:
    """The fp32 model's perplexity on `reference_ids`, the baseline of the round-to-nearest gates."""
    return perplexity(ref.model, reference_ids).perplexity


def test_perplexity_g32_within_1_percent(ref, base_perplexity: float, reference_ids) -> None:
    """Projections at group 32 (the embedding / tied LM head kept fp32, as gpt-fast does)."""
    base = base_perplexity
    q = perplexity(quantize_model(copy.deepcopy(ref.model), 32), reference_ids).perplexity  # the fp32 GGUF load
    assert 4.0 < base < 8.0
    assert abs(q / base - 1) < 0.01, (base, q)


@pytest.mark.xfail(strict=True, reason="round-to-nearest misses it: measured +51% (projections) / +72% (with "
                   "embedding) on 20k tokens of SmolLM2-135M Q4_1 requantized at group 128. The calibrated path "
                   "(GPTQ + end-to-end tuning) meets it: test_perplexity_gptq_tuned_g128_within_10_percent")
def test_perplexity_g128_within_10_percent(int4_g128: tuple[Path, dict], base_perplexity: float,
                                           reference_ids) -> None:
    """The folder `tokenmill quantize` writes at group 128 (embedding INT4 too), loaded back in fp32."""
    base = base_perplexity
    q = perplexity(open_model(str(int4_g128[0]), torch.float32, CPU, tokenizer=False).model, reference_ids).perplexity
    assert q / base - 1 < 0.10, (base, q)


@pytest.mark.quality
def test_perplexity_gptq_tuned_g128_within_10_percent(gguf_path: str, ref, data_dir, tmp_path) -> None:
    """The issue's g128 gate on the full 20k-token sample, through what a user runs: `tokenmill quantize --method
    gptq --keep-embedding` with its defaults (GSM8K question+answer and AlpacaEval instructions, not the evaluation
    text), the folder loaded back, perplexity on AlpacaEval reference answers. About 14 minutes on 2 CPU cores:
    `make quality`."""
    t = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question", "answer"])
    gsm = [f"{q}\n{a}" for q, a in zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True)]
    alpaca = pq.read_table(data_dir / "alpaca_eval.parquet", columns=["instruction", "reference_output"])
    ids = text_token_ids(ref.tokenizer, alpaca.column(1).to_pylist(), 20000)
    out = str(tmp_path / "g128")
    quantize_to_folder(gguf_path, out, 4, 128, include_embedding=False, method="gptq",
                       calibration=[gsm, alpaca.column(0).to_pylist()])
    base = perplexity(ref.model, ids).perplexity
    q = perplexity(open_model(out, torch.float32, CPU).model, ids).perplexity
    assert abs(base - 5.4285) < 0.01, base  # the fp32 figure of bench/README.md
    assert q / base - 1 < 0.10, (base, q)
