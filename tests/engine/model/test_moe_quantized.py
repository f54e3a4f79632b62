"""INT4 and INT8 experts of the mixture-of-experts families (issue 43; engine.quant.experts), from an HF folder, a GGUF
file and a tokenmill folder: greedy tokens on real prompts identical to HF transformers run on the weights the
kernels hold (the quantized model dequantized: tests/engine/moe_quant_models.loaded_weights; for W8A8 with HF's
activations rounded per token as the kernel rounds them), GGUF Q4 expert tensors kept INT4 bit-equal to gguf-py's
dequantization, GGUF block types' raw blocks serving each expert's small-batch kernel, the preflight counting the
experts' INT4 bytes as the load holds them, and `tokenmill quantize --method gptq` of a MoE model refused before any
work.

The models: tests/engine/moe_models.py's tiny Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral, here with tied
embeddings (a plain LM head: the INT4 fit of its 49k rows would cost seconds per load). fp32 on the CPU: INT4 runs
dequantize-then-GEMM on exact weights, so HF on the dequantized weights is the same function. On CUDA (the grouped
INT4 kernel, CUDA graphs, the per-expert loop without Triton): test_moe_int4_cuda.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_models import assert_hf_greedy
from llama_family_models import MAX_TOKENS, hf_argmax, hf_greedy
from moe_models import FAMILIES, hf_holding, write_moe_gguf
from moe_quant_models import loaded_weights, w8a8_activations
from torch import nn

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loading.open_model import open_model
from engine.loading.quantized import read_state
from engine.ptq.to_folder import quantize_to_folder
from engine.quant.int4_linear import Int4Linear
from engine.quant.qparams import Int4Weight
from engine.quant.stacked_int4 import StackedInt4

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

CPU = torch.device("cpu")
GROUP = 32
ENGINE = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=512)
T = gguf.GGMLQuantizationType


@pytest.fixture
def moe(moe_tied: dict[str, tuple]) -> dict[str, tuple]:
    return moe_tied


@pytest.fixture
def prompt_ids(moe_prompt_ids: list[list[int]]) -> list[list[int]]:
    return moe_prompt_ids


def _generate(loaded, prompt_ids: list[list[int]]) -> tuple[list[list[int]], dict[str, torch.Tensor], LLMEngine]:
    """(greedy tokens, the weights its kernels hold, the engine) of an OpenedModel, served as LLMEngine serves it."""
    weights = loaded_weights(loaded.model)
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, ENGINE, "moe", CPU, torch.float32)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    tokens = [o.output_token_ids for o in outs]
    assert len({t for r in tokens for t in r}) > 30, "degenerate random model"
    return tokens, weights, engine


@pytest.mark.parametrize(("family", "source"), [("qwen3_moe", 1), ("qwen2_moe", 1), ("mixtral", 2)])
def test_int4_experts_match_hf_on_the_dequantized_model(family: str, source: int, moe, prompt_ids) -> None:
    """quantization int4 of an HF folder (Qwen3-MoE, Qwen2-MoE) or a GGUF file (Mixtral): every expert's gate/up and
    down INT4 (the stacked layout GroupedExperts.int4_experts exposes), the router dense, a shared expert INT4 as a
    dense MLP; greedy tokens = HF's on the dequantized weights, teacher-forced and by `generate`."""
    model = moe[family][0]
    loaded = open_model(str(moe[family][source]), torch.float32, CPU, quantization="int4", group_size=GROUP)
    mlp = loaded.model.layers[0].mlp
    gate_up, down = mlp.experts.int4_experts()
    assert gate_up.qweight.dtype == torch.uint8 and gate_up.qweight.shape == (8, 2 * mlp.experts.intermediate_size, 32)
    assert down.scales.shape == (8, 64, -(-mlp.experts.intermediate_size // GROUP))
    assert all(isinstance(m, Int4Linear) for m in (*mlp.experts.gemms[0], *mlp.experts.gemms[1]))
    assert type(mlp.gate) is nn.Linear
    if mlp.shared_expert is not None:
        assert isinstance(mlp.shared_expert.gate_proj, Int4Linear) and type(mlp.shared_expert_gate) is nn.Linear
    ours, weights, engine = _generate(loaded, prompt_ids)
    assert engine.runner.model.layers[0].mlp.experts.int4_experts() is None  # the CPU's: released, each expert packed
    reference = hf_holding(model, weights)
    assert hf_argmax(reference, prompt_ids, ours) == ours
    assert hf_greedy(reference, prompt_ids[:1]) == ours[:1]
    assert hf_argmax(model, prompt_ids, ours) != ours  # the INT4 weights are not the fp32 ones


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_experts_match_hf_in_w8a8(family: str, moe, prompt_ids, int8_qmax: float) -> None:
    """quantization int8: one W8A8 Int8Linear per expert's gate/up and down, the block's input smoothed into the
    norm, experts, router and shared expert; greedy tokens = HF's on those weights (8-bit, or 7-bit where the CPU's
    int8 GEMM has no VNNI: the int8_qmax fixture runs both) with its projections' inputs rounded per token as the
    kernel rounds them (the router, shared-expert gate and LM head left in fp32), a near tie allowed once in 100."""
    from engine.quant.int8_linear import Int8Linear
    model, folder, _ = moe[family]
    loaded = open_model(str(folder), torch.float32, CPU, quantization="int8")
    experts = loaded.model.layers[1].mlp.experts
    assert all(isinstance(m, Int8Linear) for m in (*experts.gemms[0], *experts.gemms[1]))
    ours, weights, engine = _generate(loaded, prompt_ids)
    reference = hf_holding(model, weights)
    reference.set_experts_implementation("eager")  # HF's per-expert F.linear loop (its default grouped_mm has none)
    layers = reference.model.layers
    keep = [reference.lm_head.weight, *(layer.mlp.gate.weight for layer in layers),
            *(layer.mlp.shared_expert_gate.weight for layer in layers if hasattr(layer.mlp, "shared_expert_gate"))]
    with w8a8_activations(keep):
        assert_hf_greedy(reference, prompt_ids, ours, rel=5e-3)


def _gguf_experts(path) -> dict[str, np.ndarray]:
    """{our stacked expert module name: gguf-py's dequantization [E, N, K]} of a GGUF file's _exps tensors, read by
    the engine's parse of the file (a gguf.GGUFReader with the same tensors, test_weights_cache.py; parsed once for
    the test and the loads: tests/engine/conftest.py)."""
    from engine.loading import gguf_file

    names = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    out = {}
    for t in gguf_file.open_gguf(str(path)).tensors:
        _, layer, kind = (t.name.split(".") + ["", ""])[:3]
        if kind in names:
            out[f"layers.{layer}.mlp.experts.{names[kind]}"] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                [int(d) for d in reversed(t.shape)])
    return out


def test_gguf_q4_experts_stay_int4_bit_equal_to_gguf(moe, gguf_path: str, prompt_ids, tmp_path) -> None:
    """A GGUF file with Q4_0 gate/up and Q4_1 down expert tensors (Mixtral: its expert width, 96, is whole 32-weight
    blocks): under quantization auto every expert is INT4 as stored (no requantizing), its weights gguf-py's bit for
    bit, and the greedy tokens HF's on those weights."""
    model, folder, _ = moe["mixtral"]
    path = tmp_path / "q4.gguf"
    write_moe_gguf(path, "mixtral", folder, gguf_path, expert_type=T.Q4_0, down_type=T.Q4_1)
    _, state = read_state(str(path), "auto", GROUP)
    for name, want in _gguf_experts(path).items():
        assert isinstance(state[name], StackedInt4) and state[name].num_experts == 8, name
        assert torch.equal(state[name].dequantize(), torch.from_numpy(want)), name
    loaded = open_model(str(path), torch.float32, CPU, quantization="auto")
    ours, weights, _ = _generate(loaded, prompt_ids)
    assert hf_argmax(hf_holding(model, weights), prompt_ids, ours) == ours


def test_gguf_block_experts_serve_the_small_batch_kernel(moe, gguf_path: str, prompt_ids, tmp_path) -> None:
    """Q8_0 gate/up and Q4_0 down expert tensors (Mixtral): under quantization none (fp32, the default) each
    expert's packed GEMMs keep their rows of the raw blocks, which decode steps multiply by
    (engine.quant.packed_linear), greedy tokens HF's on gguf-py's weights; under auto the Q4_0 down is INT4 and the
    Q8_0 gate/up plain."""
    from engine.quant.experts import describe_experts
    from engine.quant.packed_linear import PackedLinear

    model, folder, _ = moe["mixtral"]
    path = tmp_path / "q8.gguf"
    write_moe_gguf(path, "mixtral", folder, gguf_path, expert_type=T.Q8_0, down_type=T.Q4_0)
    want = _gguf_experts(path)
    engine = LLMEngine.from_model(str(path), ENGINE)
    experts = engine.runner.model.layers[1].mlp.experts
    for e in (0, 7):
        gate_up, down = experts.gemms[0][e], experts.gemms[1][e]
        assert isinstance(gate_up, PackedLinear) and gate_up.blocks.type_name == "Q8_0"
        assert down.blocks.type_name == "Q4_0"
        assert torch.equal(gate_up.blocks.dequantize(), torch.from_numpy(np.concatenate(
            [want["layers.1.mlp.experts.gate_proj"][e], want["layers.1.mlp.experts.up_proj"][e]])))
        assert torch.equal(down.blocks.dequantize(), torch.from_numpy(want["layers.1.mlp.experts.down_proj"][e]))
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    ours = [o.output_token_ids for o in outs]
    _, plain = read_state(str(path), "none", GROUP)
    assert hf_argmax(hf_holding(model, plain), prompt_ids, ours) == ours
    auto = open_model(str(path), torch.float32, CPU, quantization="auto", tokenizer=False).model
    assert describe_experts(auto) == "experts gate/up float32, down INT4 (group 32) in 2 of 2 layers; router float32"


def test_q4_k_experts_map_exactly() -> None:
    """Stacked Q4_K experts (llama.cpp's Q4_K_M gate/up) map to a StackedInt4 whose experts are the 2-D
    mapping of their rows, equal to gguf-py's weights (small zeros, as in trained models: engine.loading.gguf_int4)."""
    from gguf_models import random_tensor

    from engine.loading.gguf_int4 import gguf_q4_to_int4

    e, n, k = 4, 16, 256
    raw = random_tensor(T.Q4_K, e * n, k, 0.02, np.random.default_rng(5))
    stacked = gguf_q4_to_int4(raw, "Q4_K", (e, n, k))
    assert stacked.num_experts == e and stacked.qweight.shape == (e, n, k // 2) and stacked.group_size == 32
    want = torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K)).view(e, n, k)
    assert bool((stacked.zeros.abs() < 1).all())
    assert torch.equal(stacked.dequantize(), want)
    for i in (0, 3):
        alone = gguf_q4_to_int4(raw[i * n:(i + 1) * n], "Q4_K", (n, k))
        assert torch.equal(stacked.expert(i).qweight, alone.qweight) and torch.equal(stacked.expert(i).zeros,
                                                                                       alone.zeros)


def test_preflight_counts_int4_experts_as_the_load_holds_them(moe, gguf_path: str, tmp_path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The fit check's weight bytes (from headers only) are those of the state the loader builds, padding aside: INT4
    experts on load from an HF folder, Q4_0 GGUF experts kept under auto (beside plain F32 ones). On a (simulated)
    CUDA device the experts count once with their scales as stored (fp32 from GGUF, bf16 quantized on load) where
    the grouped INT4 kernel holds them, and as the layout's per-expert copies under TOKENMILL_TRITON_MOE=0."""
    import jobs.plan.model_fit
    from engine.quant.handler import held_tensors
    from engine.worker.memory_fit import grouped_int4_experts_expected, weight_bytes
    from jobs.plan.model_fit import model_fit
    from jobs.plan.preflight import model_context

    _, folder, _ = moe["qwen2_moe"]
    path = tmp_path / "mixed.gguf"
    write_moe_gguf(path, "qwen2_moe", folder, gguf_path, expert_type=T.Q4_0)
    for model, mode in ((folder, "int4"), (path, "auto"), (path, "int4")):
        cfg, state = read_state(str(model), mode, GROUP)

        def fit(device: str, model: object = model, mode: str = mode) -> object:
            return model_fit(str(model), EngineConfig(device=device, dtype="float32", quantization=mode,
                                                      int4_group_size=GROUP), model_context(str(model)))

        # the header-only count leaves out INT4's padding columns (K rounded up to the group: 48 -> 64 here)
        held = [(w.num_experts * w.out_features * w.in_features, w.group_size, True, w.scales.element_size())
                if isinstance(w, StackedInt4) else (w.out_features * w.in_features, w.group_size)
                if isinstance(w, Int4Weight) else (w.numel(), None) for w in state.values()]
        cpu = fit("cpu")
        assert cpu.model_bytes == weight_bytes(held, "float32", "cpu"), (model, mode)
        assert weight_bytes(held_tensors(cfg, state), "float32", "cpu") - cpu.model_bytes < 0.01 * cpu.model_bytes
        int4 = {name for name, w in state.items() if isinstance(w, StackedInt4)}
        assert len(int4) == (4 if mode == "auto" else 6), (model, mode)
        with monkeypatch.context() as m:
            m.setattr(jobs.plan.model_fit, "resolve_device", lambda device: jobs.plan.model_fit.Device("cuda", 0))
            m.setattr(jobs.plan.model_fit, "_cuda_memory", lambda index: (80 << 30, 80 << 30, "NVIDIA H100 80GB HBM3"))
            grouped = fit("cuda")
            assert grouped.model_bytes == weight_bytes(held, "float32", "cuda", grouped.int4_layout), (model, mode)
            padded = weight_bytes(held_tensors(cfg, state), "float32", "cuda", grouped.int4_layout)
            assert padded - grouped.model_bytes < 0.01 * grouped.model_bytes
            m.setenv("TOKENMILL_TRITON_MOE", "0")
            loop = fit("cuda")
            assert loop.model_bytes == weight_bytes(held, "float32", "cuda", loop.int4_layout, grouped_experts=False)
            if grouped_int4_experts_expected("cuda") and grouped.int4_layout == loop.int4_layout == "dual":
                assert loop.model_bytes > grouped.model_bytes, (model, mode)


def test_tokenmill_quantize_of_a_moe_model(moe, prompt_ids, tmp_path) -> None:
    """`tokenmill quantize` (round-to-nearest) writes the experts INT4 into the folder, which loads them as stored
    and runs as HF on those weights; --method gptq is refused before any work, naming the way out."""
    model, folder, _ = moe["qwen2_moe"]
    with pytest.raises(ValueError, match=r"--method gptq of a mixture-of-experts model \(qwen2_moe, 8 experts\) is "
                                         r"not implemented; use --method rtn"):
        quantize_to_folder(str(folder), str(tmp_path / "gptq"), method="gptq", calibration=[["calibration text"]])
    assert not (tmp_path / "gptq").exists()
    meta = quantize_to_folder(str(folder), str(tmp_path / "q4"), group_size=GROUP, include_embedding=False)
    assert {"layers.1.mlp.experts.gate_proj", "layers.1.mlp.experts.down_proj"} <= set(meta["quantization"]["modules"])
    loaded = open_model(str(tmp_path / "q4"), torch.float32, CPU, quantization="auto")
    assert loaded.model.layers[1].mlp.experts.int4_experts()[1].num_experts == 8
    ours, weights, _ = _generate(loaded, prompt_ids[:4])
    assert hf_argmax(hf_holding(model, weights), prompt_ids[:4], ours) == ours


def test_int4_experts_in_bf16_follow_fp32() -> None:
    """bf16 on the CPU (each expert's Int4Linear on torch's packed int4 kernel): the experts' output within bf16
    rounding of the fp32 dequantize-then-GEMM path on the same INT4 weights and routing."""
    from engine.layers.moe import GroupedExperts, route
    from engine.quant.experts import expert_modules
    from engine.quant.qparams import quantize_int4

    gen = torch.Generator().manual_seed(0)
    gate_up, down = (StackedInt4.from_weights([quantize_int4(w, GROUP) for w in torch.randn(shape, generator=gen)
                                               * 0.1]) for shape in ((8, 192, 64), (8, 64, 96)))
    x = torch.randn(40, 64, generator=gen)
    weights, ids = route(torch.randn(40, 8, generator=gen), 2, "softmax_topk", True)
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        experts = GroupedExperts(8, 64, 96)
        experts.set_gemms(expert_modules(gate_up, dtype, CPU), expert_modules(down, dtype, CPU))
        with torch.no_grad():
            outs[dtype] = experts(x.to(dtype), ids, weights.to(dtype)).float()
    cos = torch.nn.functional.cosine_similarity(outs[torch.bfloat16], outs[torch.float32], dim=-1)
    assert cos.min().item() > 0.999
