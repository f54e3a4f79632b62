"""INT4 weight-only quantization: packing, Int4Linear against a dequantized reference, GGUF Q4 loaded natively,
model folders (quantize -> save -> load -> generate), folder sizes and perplexity on real text."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from engine.attention import paged_attention_ref
from engine.perplexity import perplexity, text_token_ids
from engine.quant.calibration import calibration_token_ids
from engine.quant.folder import folder_bytes, read_folder, save_folder
from engine.quant.gguf_int4 import gguf_q4_to_int4
from engine.quant.gptq import HessianAccumulator, gptq_quantize_weight, output_error
from engine.quant.int4_linear import Int4Embedding, Int4Linear
from engine.quant.loading import load_model, quantize_to_folder
from engine.quant.qparams import Int4Weight, pack_uint4, quantize_int4, unpack_uint4
from engine.quant.quantize import quantize_model
from engine.quant.refit import refit_group_qparams
from engine.quant.state import LINEAR_MODULES
from engine.quant.tune import distillation_kl, tune_group_qparams
from engine.sequence_forward import forward_sequence, private_prefill

CPU = torch.device("cpu")
PPL_TOKENS = 2048  # one forward each of 2 chunks; the full-sample figures are in bench/README.md


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one sequence from an empty private KV cache in the model's dtype."""
    with torch.inference_mode():
        return model.compute_logits(forward_sequence(model, torch.tensor(ids)))


@pytest.fixture(scope="module")
def ref(gguf_path: str):
    return load_model(gguf_path, torch.float32, CPU, quantization="none")


@pytest.fixture(scope="module")
def reference_ids(ref, data_dir) -> list[int]:
    texts = pq.read_table(data_dir / "alpaca_eval.parquet", columns=["reference_output"]).column(0).to_pylist()
    return text_token_ids(ref.tokenizer, texts, PPL_TOKENS)


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
    with pytest.raises(ValueError, match="Q4_0, Q4_1"):
        gguf_q4_to_int4(raw, "Q8_0", (16, 128))


def test_gguf_q4_1_native_logits_match_dequantized(gguf_path: str, ref, alpaca_instructions) -> None:
    native = load_model(gguf_path, torch.float32, CPU, quantization="auto")
    assert native.num_int4_modules == 30 * 7  # every projection of SmolLM2-135M is Q4_1
    assert isinstance(native.model.layers[0].self_attn.q_proj, Int4Linear)
    for prompt in alpaca_instructions[:2]:
        ids = ref.tokenizer.encode(prompt)
        a, b = _logits(ref.model, ids), _logits(native.model, ids)
        assert ((a - b).norm() / a.norm()).item() < 1e-3
    # bf16 through the tinygemm CPU kernel: same argmax on most positions (bf16 activations).
    bf = load_model(gguf_path, torch.bfloat16, CPU, quantization="auto")
    ids = ref.tokenizer.encode(alpaca_instructions[0])
    agree = (_logits(bf.model, ids).argmax(-1) == _logits(ref.model, ids).argmax(-1)).float().mean().item()
    assert agree > 0.8


def _greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(_logits(model, ids + out)[-1].argmax()))
    return out


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_fused_projections_give_the_same_greedy_tokens(gguf_path: str, ref, alpaca_instructions,
                                                       quantization: str) -> None:
    """The serving layout (one QKV and one gate/up GEMM per layer, plain fp32 and INT4 Q4_1) computes what the
    file's separate projections compute: logits within fp32 rounding, the same greedy tokens."""
    unfused = ref if quantization == "none" else load_model(gguf_path, torch.float32, CPU, quantization=quantization)
    fused = copy.deepcopy(unfused.model)
    assert fused.fuse_projections() == 2 * unfused.config.num_layers
    assert fused.fuse_projections() == 0  # idempotent
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    kind = torch.nn.Linear if quantization == "none" else Int4Linear
    assert isinstance(attn.qkv_proj, kind) and isinstance(mlp.gate_up_proj, kind)
    assert attn.qkv_proj.out_features == (unfused.config.num_heads + 2 * unfused.config.num_kv_heads) * 64
    for prompt in alpaca_instructions[:2]:
        ids = ref.tokenizer.encode(prompt)
        a, b = _logits(unfused.model, ids), _logits(fused, ids)
        assert ((a - b).norm() / a.norm()).item() < 1e-5
        assert _greedy(fused, ids, 6) == _greedy(unfused.model, ids, 6)


def test_quantize_save_load_generate(gguf_path: str, tmp_path) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams

    int4_dir, bf16_dir = tmp_path / "int4", tmp_path / "bf16"
    meta = quantize_to_folder(gguf_path, str(int4_dir), bits=4, group_size=128)
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
def test_perplexity_g128_within_10_percent(ref, base_perplexity: float, reference_ids) -> None:
    base = base_perplexity
    q = perplexity(quantize_model(copy.deepcopy(ref.model), 128), reference_ids).perplexity
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
    q = perplexity(load_model(out, torch.float32, CPU).model, ids).perplexity
    assert abs(base - 5.4285) < 0.01, base  # the fp32 figure of bench/README.md
    assert q / base - 1 < 0.10, (base, q)


def _down_proj_inputs(model: torch.nn.Module, ids: torch.Tensor, layer_index: int) -> torch.Tensor:
    """Real inputs of layers.{layer_index}.mlp.down_proj: fp32 [S * L, 1536] for token ids int64 [S, L], each row
    a sequence from position 0 (so its first token carries the model's attention-sink activations)."""
    n = ids.shape[1]
    meta, caches = private_prefill(model.config, n, torch.float32, CPU)
    cos, sin = model.rotary(torch.arange(n), torch.float32)
    seen: list[torch.Tensor] = []
    handle = model.layers[layer_index].mlp.down_proj.register_forward_hook(lambda _m, a, _o: seen.append(a[0]))
    try:
        with torch.inference_mode():
            for row in ids:
                h = model.embed_tokens(row)
                for layer in model.layers[:layer_index + 1]:
                    h = layer(h, cos, sin, *caches, meta, paged_attention_ref)
    finally:
        handle.remove()
    return torch.cat(seen)


@pytest.fixture(scope="module")
def calibration_ids(ref, data_dir):
    """(calibration, held-out GSM8K, held-out AlpacaEval answers) token ids, int64 [32 | 4 | 4, 256]: calibration
    is 4,096 GSM8K question+answer tokens and 4,096 AlpacaEval instruction tokens, as bench/int4.py calibrates;
    held out are 1,024 other GSM8K tokens (same domain) and 1,024 AlpacaEval reference-answer tokens (the
    perplexity text)."""
    t = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question", "answer"])
    gsm = [f"{q}\n{a}" for q, a in zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True)]
    alpaca = pq.read_table(data_dir / "alpaca_eval.parquet", columns=["instruction", "reference_output"])
    gsm_ids = calibration_token_ids(ref.tokenizer, gsm, 20, 256)
    calib = torch.cat((gsm_ids[:16], calibration_token_ids(ref.tokenizer, alpaca.column(0).to_pylist(), 16, 256)))
    return calib, gsm_ids[16:], calibration_token_ids(ref.tokenizer, alpaca.column(1).to_pylist(), 4, 256)


@pytest.fixture(scope="module")
def gptq_down_proj(ref, calibration_ids):
    """GPTQ g128 (damp 0.1, act-order) of the real layers.0.mlp.down_proj (K=1536) on `calibration_ids`.
    Returns (weight, GPTQ Int4Weight, held-out GSM8K X, held-out AlpacaEval X)."""
    calib, gsm, answers = calibration_ids
    x_calib, x_gsm, x_answers = (_down_proj_inputs(ref.model, ids, 0) for ids in (calib, gsm, answers))
    acc = HessianAccumulator(x_calib.shape[1])
    acc.add(x_calib)
    w = ref.model.layers[0].mlp.down_proj.weight.detach()
    return w, gptq_quantize_weight(w, acc.hessian, 128, damp=0.1, act_order=True), x_gsm, x_answers


def test_gptq_beats_round_to_nearest_on_real_layer(gptq_down_proj) -> None:
    """On held-out real inputs GPTQ's output error ||XW^T - XWq^T|| / ||XW^T|| must be below round-to-nearest's
    (same group size, same MSE scale fit, same bf16 scales). Layer 0's MLP is the hardest case for calibration
    (its inputs depend on the tokens: damp 0.01 with GSM8K-only calibration was *worse* than RTN on AlpacaEval
    answers, 0.076 vs 0.061). Measured here: see the bounds' comments."""
    w, q, x_gsm, x_answers = gptq_down_proj
    for x, bound in ((x_gsm, 0.7), (x_answers, 0.9)):
        rtn = output_error(x, w, quantize_int4(w, 128).dequantize())
        gptq = output_error(x, w, q.dequantize())
        assert 0.01 < rtn < 0.2, rtn  # a real 4-bit error, not a degenerate layer
        assert gptq < bound * rtn, (gptq, rtn, bound)


def test_refit_recovers_the_grid_a_weight_lies_on() -> None:
    """A weight exactly on an INT4 grid (known codes, scales, zeros; K=320 so the last group of 128 is padded) is
    reproduced by refit_group_qparams from its codes alone, for a Hessian with two massive input features (which
    make the normal equations badly conditioned in fp32: scales come back within 0.15%). With bf16 scales the
    refit, which solves the zeros again for the rounded scales, beats rounding the true parameters to bf16."""
    gen = torch.Generator().manual_seed(0)
    n, k, g = 48, 320, 128
    codes = torch.randint(0, 16, (n, k), generator=gen).float()
    scales = torch.rand(n, 3, generator=gen) * 0.05 + 0.01
    zeros = torch.randn(n, 3, generator=gen) * 0.1

    def grid(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (codes - 8) * s.float().repeat_interleave(g, 1)[:, :k] + z.float().repeat_interleave(g, 1)[:, :k]

    w = grid(scales, zeros)
    x = torch.randn(512, k, generator=gen)
    x[0, [5, 200]] = 3000.0  # attention-sink-like features, on one token
    h = 2 * x.t() @ x / x.shape[0]
    s32, z32 = refit_group_qparams(w, codes, h, g, torch.float32)
    assert torch.allclose(s32, scales, rtol=5e-3) and torch.allclose(z32, zeros, atol=2e-3)
    assert output_error(x, w, grid(s32, z32)) < 1e-4
    s16, z16 = refit_group_qparams(w, codes, h, g, torch.bfloat16)
    assert s16.dtype == z16.dtype == torch.bfloat16 and s16.shape == (n, 3)
    rounded = output_error(x, w, grid(scales.bfloat16(), zeros.bfloat16()))  # measured 1.6e-3
    assert output_error(x, w, grid(s16, z16)) < rounded  # measured 9.8e-4


def test_gptq_keeps_massive_activation_features_accurate(ref, calibration_ids) -> None:
    """layers.11.mlp.down_proj of SmolLM2-135M meets a "massive activation" (one input feature near 3,000 on the
    first token, Sun et al. 2024): round-to-nearest at g128 alone costs +9.6% perplexity there (bench/README.md).
    GPTQ's group fit weighted by H_jj and its Hessian refit of the scales must cut the held-out output error
    (AlpacaEval answers, each sequence from position 0) to a small fraction of round-to-nearest's, and below GPTQ
    as published (unweighted min-max fit, no refit)."""
    calib, _, answers = calibration_ids
    x_calib, x_answers = (_down_proj_inputs(ref.model, ids, 11) for ids in (calib, answers))
    assert x_answers.abs().max() > 1000  # the massive activation is there
    acc = HessianAccumulator(x_calib.shape[1])
    acc.add(x_calib)
    w = ref.model.layers[11].mlp.down_proj.weight.detach()
    rtn = output_error(x_answers, w, quantize_int4(w, 128).dequantize())
    plain = output_error(x_answers, w, gptq_quantize_weight(w, acc.hessian, 128, act_order=True, refit=False,
                                                            method="minmax").dequantize())
    gptq = output_error(x_answers, w, gptq_quantize_weight(w, acc.hessian, 128, act_order=True).dequantize())
    # measured: round-to-nearest 0.0667, GPTQ as published 0.0045, weighted fit 0.0019, weighted + refit 0.0018
    assert gptq < 0.1 * rtn and gptq < 0.6 * plain, (gptq, plain, rtn)


def test_gptq_weight_round_trips_through_folder(ref, gptq_down_proj, tmp_path) -> None:
    """The GPTQ result is an ordinary Int4Weight: valid codes and shapes, saved and read back bit for bit, and the
    loaded Int4Linear (fp32, dequantize-then-GEMM) computes exactly X Wq^T."""
    w, q, x, _ = gptq_down_proj
    assert isinstance(q, Int4Weight) and q.group_size == 128 and q.in_features == 1536
    assert q.qweight.shape == (576, 1536 // 2) and q.scales.shape == (576, 12) and q.scales.dtype == torch.bfloat16
    state = {k: v for k, v in ref.model.state_dict().items() if k != "lm_head.weight"}
    del state["layers.0.mlp.down_proj.weight"]
    state["layers.0.mlp.down_proj"] = q
    save_folder(str(tmp_path), ref.config, state, None, bits=4, group_size=128, source="test", method="gptq")
    _, back, meta = read_folder(str(tmp_path))
    assert meta["quantization"]["method"] == "gptq"
    got = back["layers.0.mlp.down_proj"]
    assert isinstance(got, Int4Weight)
    for part in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(got, part), getattr(q, part)), part
    lin = Int4Linear(got, torch.float32, CPU)
    xs = x[:64]
    assert torch.allclose(lin(xs), xs @ q.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_tuning_scales_and_zeros_lowers_held_out_kl(ref, calibration_ids) -> None:
    """Round-to-nearest g128 codes for every projection, then tune_group_qparams on 32 calibration sequences of 64
    tokens (GSM8K + AlpacaEval instructions, one pass; lr 3e-3, as round-to-nearest codes start far from the
    optimum): on AlpacaEval reference answers it never saw, the KL from
    the fp32 model to the quantized one must fall, with every code unchanged and the model holding exactly the
    dequantized tuned weights (bf16 scales and zeros, what the folder stores), its RMSNorm gains tuned too and the
    teacher untouched."""
    calib, _, answers = calibration_ids
    m = copy.deepcopy(ref.model)  # the fp32 GGUF load, a student of its own
    rtn: dict[str, Int4Weight] = {}
    for name, module in m.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR_MODULES:
            rtn[name] = quantize_int4(module.weight.detach(), 128)
            module.weight.data = rtn[name].dequantize()

    def held_out_kl() -> float:
        with torch.no_grad():
            return sum(distillation_kl(m, ref.model, row).item() for row in answers[:, :128]) / answers.shape[0]

    before = held_out_kl()
    teacher_norms = {n: p.clone() for n, p in ref.model.named_parameters() if n.endswith("norm.weight")}
    tuned = tune_group_qparams(m, ref.model, rtn, calib[:, :64], epochs=1.0, lr=3e-3)  # 16 steps, about 40 s
    after = held_out_kl()
    assert 0.05 < before < 1.0, before  # a real 4-bit error
    assert after < 0.8 * before, (after, before)  # measured 0.511 -> 0.330
    assert tuned.keys() == rtn.keys()
    moved = 0
    for name, w in tuned.items():
        assert torch.equal(w.qweight, rtn[name].qweight), name
        assert w.scales.dtype == w.zeros.dtype == torch.bfloat16
        assert torch.equal(m.get_submodule(name).weight, w.dequantize()), name
        moved += int(not torch.equal(w.scales, rtn[name].scales))
    assert moved == len(rtn)
    assert len(teacher_norms) == 2 * m.config.num_layers + 1
    for n, p in teacher_norms.items():
        assert torch.equal(ref.model.get_parameter(n), p), n  # the teacher is only run forward
        assert not torch.equal(m.get_parameter(n), p), n  # the student's gains were tuned
    assert all(p.requires_grad for p in m.parameters())  # flags restored


def test_quantize_model_calibrated_beats_round_to_nearest(ref, calibration_ids) -> None:
    """quantize_model end to end with calibration (GPTQ, then scales/zeros and norm gains tuned) on the real model's
    first two decoder layers, embedding INT4 too: every projection, the embedding and the tied LM head are INT4
    modules, and the KL from the fp32 two-layer model on AlpacaEval answers neither saw is well below
    round-to-nearest's (same group size, same INT4 embedding, whose error both share). Measured: see the bound's
    comment."""
    calib, _, answers = calibration_ids
    teacher = copy.deepcopy(ref.model)
    teacher.layers = teacher.layers[:2]
    teacher.config = dataclasses.replace(teacher.config, num_layers=2)
    rtn = quantize_model(copy.deepcopy(teacher), 128, include_embedding=True)
    steps: list[float] = []
    calibrated = quantize_model(copy.deepcopy(teacher), 128, include_embedding=True, calibration=calib[:, :64],
                                act_order=True, tune_epochs=1.0, on_tune_step=lambda i, n, kl: steps.append(kl))

    def held_out_kl(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return sum(distillation_kl(m, teacher, row).item() for row in answers[:, :128]) / answers.shape[0]

    assert len(steps) == 16  # 32 sequences, 2 per step, one epoch
    for m in (rtn, calibrated):
        assert isinstance(m.embed_tokens, Int4Embedding) and isinstance(m.lm_head, Int4Linear)
        projections = [mod for n, mod in m.named_modules() if n.rsplit(".", 1)[-1] in LINEAR_MODULES]
        assert len(projections) == 2 * len(LINEAR_MODULES)
        assert all(isinstance(mod, Int4Linear) for mod in projections)
    assert not torch.equal(calibrated.norm.weight, teacher.norm.weight)  # the gains were tuned
    kl_rtn, kl_cal = held_out_kl(rtn), held_out_kl(calibrated)
    assert 0.001 < kl_rtn < 1.0, kl_rtn  # a real 4-bit error
    assert kl_cal < 0.85 * kl_rtn, (kl_cal, kl_rtn)  # measured 0.191 vs 0.251
