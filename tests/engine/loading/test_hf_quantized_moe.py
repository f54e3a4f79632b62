"""Quantized mixture-of-experts HF folders (issue 43 item 3): GPTQ (act-order, each expert its own input order), AWQ
GEMM and compressed-tensors pack-quantized checkpoints of the tiny Qwen3-MoE, Mixtral (w1/w2/w3 under
block_sparse_moe) and Qwen2-MoE (shared expert), their per-expert layers (model.layers.0.mlp.experts.3.gate_proj.
qweight ...) stacked on load: each projection's experts one stacked INT4 weight as stored under quantization auto,
weights equal bit for bit to the writer's reference, the router and shared-expert gate as the checkpoint stores them
(unquantized), the load report naming the experts, and greedy tokens identical to HF transformers loading the
reference (dequantized) folder itself. A W8A8 folder's INT8 experts run dequantized exactly, and the report says so.

The writers: tests/engine/loading/quant_writers.py (each format's packing); the folders: moe_quant_models.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from family_models import chat_prompt_ids
from moe_models import build_moe_families
from moe_quant_models import write_quantized_moe

from engine import EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
import quant_writers as qw  # noqa: E402
from quant_cases import act_order_index, hf_argmax  # noqa: E402

pytestmark = pytest.mark.usefixtures("quant_cache_dir")
MAX_TOKENS = 24
ENGINE = EngineConfig(device="cpu", dtype="float32", quantization="auto", num_kv_blocks=256, max_num_seqs=8,
                      max_num_batched_tokens=512)


def _expert(module: str) -> int:
    m = re.search(r"\.experts\.(\d+)\.", module)
    return -1 if m is None else int(m.group(1))


def _gptq_act_order(module: str, w: torch.Tensor):
    # each expert its own order (its own Hessian), gate and up of one expert the same (one input)
    g_idx = act_order_index(w.shape[1], 32, seed=100 + _expert(module))
    q, z, s, g = qw.rtn(w, 4, 32, sym=False, g_idx=g_idx)
    return qw.gptq_tensors(q, z, s, g, 4, v1=True), qw.dequant(q, z, s, g)


def _awq(module: str, w: torch.Tensor):
    q, z, s, g = qw.rtn(w, 4, 32, sym=False)
    return qw.awq_tensors(q, z, s), qw.dequant(q, z, s, g)


def _ct_w4a16(module: str, w: torch.Tensor):
    q, z, s, g = qw.rtn(w, 4, 32, sym=True, scale_dtype=torch.bfloat16)
    return qw.ct_int_tensors(q, z, s.float(), 4, packed=True, sym=True), qw.dequant(q, z, s, g)


def _ct_w8a8(module: str, w: torch.Tensor):
    q, z, s, g = qw.rtn(w, 8, -1, sym=True, scale_dtype=torch.bfloat16)
    return qw.ct_int_tensors(q, z, s.float(), 8, packed=False, sym=True), qw.dequant(q, z, s, g)


_W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
_W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
_A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
# case -> (family, method, quantization_config, layer writer)
CASES = {
    "gptq-actorder-qwen3_moe": ("qwen3_moe", "gptq", {"bits": 4, "group_size": 32, "sym": False, "desc_act": True,
                                                      "checkpoint_format": "gptq"}, _gptq_act_order),
    "awq-mixtral": ("mixtral", "awq", {"bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}, _awq),
    "ct-w4a16-qwen2_moe": ("qwen2_moe", "compressed-tensors", qw.ct_config("pack-quantized", _W4), _ct_w4a16),
    "ct-w8a8-qwen2_moe": ("qwen2_moe", "compressed-tensors", qw.ct_config("int-quantized", _W8, _A8), _ct_w8a8),
}


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory: pytest.TempPathFactory, gguf_path: str, hf_tok) -> dict[str, tuple[Path, object]]:
    """case -> (quantized folder, HF fp32 model loaded by transformers from the reference folder)."""
    root = tmp_path_factory.mktemp("moe-quantized")
    models = build_moe_families(root / "plain", gguf_path, hf_tok, tie=True, width=64,  # whole groups of 32
                                gguf_families=())
    out = {}
    for case, (family, method, config, layer) in CASES.items():
        write_quantized_moe(models[family][1], root / case, root / f"{case}-ref", method, config, layer)
        out[case] = (root / case, transformers.AutoModelForCausalLM.from_pretrained(
            root / f"{case}-ref", dtype=torch.float32).eval())
    return out


@pytest.fixture(scope="module")
def prompt_ids(hf_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    return chat_prompt_ids(hf_tok, gsm8k_questions, alpaca_instructions, 8)


def _reference_experts(reference, layer: int) -> dict[str, torch.Tensor]:
    """{our stacked parameter: weight} of layer `layer`'s experts in HF's reference model."""
    sd = reference.state_dict()
    gate, up = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"].chunk(2, dim=1)
    return {"gate_proj": gate, "up_proj": up, "down_proj": sd[f"model.layers.{layer}.mlp.experts.down_proj"]}


@pytest.mark.parametrize("case", [c for c in CASES if "w8a8" not in c])
def test_int4_experts_load_as_stored_and_match_hf(case: str, moe_folders, prompt_ids) -> None:
    from engine.loading.quantized import read_state
    from engine.quant.stacked_int4 import StackedInt4

    folder, reference = moe_folders[case]
    _, plain = read_state(str(folder), "none", 128)
    _, auto = read_state(str(folder), "auto", 128)
    for layer in (0, 1):
        for proj, want in _reference_experts(reference, layer).items():
            name = f"layers.{layer}.mlp.experts.{proj}"
            assert torch.equal(plain[f"{name}.weight"], want), name
            assert isinstance(auto[name], StackedInt4) and auto[name].num_experts == 8, name
            assert torch.equal(auto[name].dequantize(), want), name
            assert (auto[name].in_perm is not None) == ("actorder" in case), name
        assert torch.equal(auto[f"layers.{layer}.mlp.gate.weight"], reference.model.layers[layer].mlp.gate.weight)
    engine = LLMEngine.from_model(str(folder), ENGINE)
    assert "(48 of them experts' projections" in engine.quantization_loaded, engine.quantization_loaded
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    ours = [o.output_token_ids for o in outs]
    assert len({t for r in ours for t in r}) > 30, "degenerate random model"
    assert hf_argmax(reference, prompt_ids, ours) == ours


def test_w8a8_experts_run_dequantized_and_say_so(moe_folders, prompt_ids, int8_qmax: float) -> None:
    """A compressed-tensors W8A8 MoE folder: its experts are dequantized exactly, and the load report says why: where
    this CPU's int8 GEMM sums the stored |q| <= 127 (VNNI), its attention and shared expert keep their INT8 on the
    W8A8 kernel and the experts are listed as having no W8A8 expert kernel for stored integers; without VNNI (63)
    every layer is dequantized, listed as beyond this CPU's INT8 limit."""
    from engine.loading.open_model import open_model
    from engine.loading.quantized import read_state

    folder, reference = moe_folders["ct-w8a8-qwen2_moe"]
    _, auto = read_state(str(folder), "auto", 128)
    for proj, want in _reference_experts(reference, 1).items():
        assert torch.equal(auto[f"layers.1.mlp.experts.{proj}.weight"], want), proj
    loaded = open_model(str(folder), torch.float32, torch.device("cpu"), quantization="auto")
    said = ("14 layers INT8 as stored (W8A8), 48 dequantized exactly (INT8 experts (no W8A8 expert kernel): 48)"
            if int8_qmax >= 127 else
            "0 layers INT4 as stored, 62 dequantized exactly (int8 weights beyond this CPU's INT8 limit (|q| <= 63 "
            "without VNNI): 62)")
    assert loaded.quantization_loaded.endswith(said), loaded.quantization_loaded

