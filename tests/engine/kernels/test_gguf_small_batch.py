"""The CPU's small-batch path on the GGUF's own blocks (engine.quant.packed_linear, engine.kernels.gguf_blocks): the
default
GGUF's projections and its tied LM head keep their raw blocks through loading, the weights cache, fusion and
packing; decode steps of at most GGUF_KERNEL_MAX_ROWS rows without a seeded row multiply by them; the greedy
tokens are the packed fp32 GEMM's on real prompts; a seeded request's are the same alone and in a crowd; blocks
whose weight changed are never used."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kernels import cpu_kernels
from engine.kernels.gguf_blocks import GGUFBlocks, gguf_linear
from engine.layers.gguf_holder import GGUFBlocksHolder
from engine.layers.linear import concat_linears
from engine.loading.open_model import open_model
from engine.quant import packed_linear
from engine.quant.after_load import pack_linears
from engine.quant.forms import GGUFBlocksForm
from engine.quant.int8_linear import int8_available, quantize_model_int8
from engine.quant.packed_linear import PackedLinear, gguf_kernel_scope
from engine.quant.smoothquant import CALIBRATION_TEXT, smooth_model
from engine.text.tokenizer import Tokenizer

CPU = torch.device("cpu")


def _blocks(type_name: str, n: int, k: int, seed: int = 0) -> GGUFBlocks:
    """Blocks of a random [n, k] weight quantized by gguf-py (the reference writer of the format)."""
    import gguf

    w = np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    return GGUFBlocks.from_raw(raw, type_name, (n, k))


def test_the_default_gguf_keeps_its_blocks_through_packing(real_engine: LLMEngine) -> None:
    model = real_engine.runner.model
    served = {name: m.blocks.type_name for name, m in model.named_modules()
              if isinstance(m, PackedLinear) and m.blocks is not None}
    layers = model.config.num_layers
    for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert [served.get(f"layers.{i}.{proj}") for i in range(layers)] == ["Q4_1"] * layers, proj
    assert served["lm_head"] == "Q8_0"  # the tied LM head multiplies by the Q8_0 token embedding
    # No linear missed packing, every packed one kept its blocks, and no holder outlived the hand-off.
    assert len(served) == 4 * layers + 1
    assert not [name for name, m in model.named_modules() if type(m) is nn.Linear or isinstance(m, GGUFBlocksHolder)]
    # The blocks are the weights: the embedding (fp32, dequantized by gguf-py at load) bit for bit.
    assert torch.equal(model.lm_head.blocks.dequantize(), model.embed_tokens.weight)


def test_small_batches_run_on_the_blocks_and_give_the_packed_gemms_tokens(
        real_engine: LLMEngine, alpaca_instructions: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    kernel = packed_linear.gguf_linear

    def counted(x: torch.Tensor, blocks: GGUFBlocks) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, blocks)

    monkeypatch.setattr(packed_linear, "gguf_linear", counted)
    prompts = alpaca_instructions[10:14]
    # The first request outlives the others: decode steps of 4 rows, then of 1 row, in one batch.
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] + [SamplingParams(max_tokens=12, ignore_eos=True)] * 3

    def run() -> list[list[int]]:
        real_engine.reset_prefix_cache()
        return [list(o.output_token_ids) for o in real_engine.generate(prompts, params)]

    on_blocks = run()
    # Decode steps only: no call had more rows than the batch's 4 (a step prefilling a prompt of tens of tokens
    # runs the packed GEMMs), and steps of 4 rows and of 1 row both ran on the blocks.
    assert set(calls) <= {1, 2, 3, 4} and {1, 4} <= set(calls)
    monkeypatch.setenv("TOKENMILL_GGUF_KERNEL", "0")  # read at each step (gguf_kernel_max_rows)
    calls.clear()
    assert run() == on_blocks
    assert not calls  # the reference run never touched the blocks
    # A seeded request keeps its tokens whatever else is in the batch (SamplingParams.seed): steps holding one run
    # the packed GEMMs, alone (a step of 1 row) as beside 3 others.
    monkeypatch.undo()
    monkeypatch.setattr(packed_linear, "gguf_linear", counted)
    calls.clear()
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    alone = real_engine.generate(prompts[:1], seeded)[0].output_token_ids
    assert not calls
    crowd = real_engine.generate(prompts[:1] + alpaca_instructions[20:23], seeded)[0].output_token_ids
    assert crowd == alone


def test_a_cached_load_keeps_the_blocks(gguf_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    built = open_model(gguf_path, torch.float32, CPU, tokenizer=False).model  # writes the cache entry
    cached = open_model(gguf_path, torch.float32, CPU, tokenizer=False).model  # reads it
    for name in ("layers.0.self_attn.q_proj", "layers.3.self_attn.k_proj", "layers.29.mlp.down_proj", "lm_head"):
        a, b = GGUFBlocksForm.of(built.get_submodule(name)), GGUFBlocksForm.of(cached.get_submodule(name))
        assert a is not None and b is not None and a.type_name == b.type_name
        assert torch.equal(a.dequantize(), b.dequantize())
        assert torch.equal(b.dequantize(), cached.get_submodule(name).weight)  # the rows un-permuted alike (Q, K)
    # Every linear of the fill is an exact nn.Linear holding its blocks (the embedding's: the tied LM head).
    linears = [m for m in cached.modules() if type(m) is nn.Linear]
    assert len(linears) == 7 * cached.config.num_layers + 1
    assert all(torch.equal(GGUFBlocksForm.of(m).dequantize(), m.weight) for m in linears)
    # A bf16 load holds no blocks: test_a_q4_k_gguf_runs_small_steps_on_its_super_blocks loads its tiny GGUF so.


def test_smoothquant_drops_the_scaled_weights_blocks_and_int8_takes_every_projection(gguf_path: str) -> None:
    """quantization "int8"'s steps on an fp32 GGUF model (Int8W8A8Form.from_float_model): SmoothQuant scales QKV,
    gate/up and down in place, which drops their blocks (o_proj and the LM head keep theirs); INT8 then replaces
    every projection, holder or not, and the LM head is packed with its blocks."""
    model = open_model(gguf_path, torch.float32, CPU, tokenizer=False).model
    model.fuse_projections()
    ids = torch.tensor(Tokenizer.from_model_path(gguf_path).encode(CALIBRATION_TEXT), dtype=torch.int64)
    with torch.no_grad():
        smooth_model(model, ids)
    for layer in model.layers:
        assert [GGUFBlocksForm.of(m) is None for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj,
                                                       layer.mlp.down_proj)] == [True] * 3
        assert torch.equal(GGUFBlocksForm.of(layer.self_attn.o_proj).dequantize(), layer.self_attn.o_proj.weight)
    if not int8_available():
        return
    assert quantize_model_int8(model) == 4 * model.config.num_layers
    assert [name for name, m in model.named_modules() if type(m) is nn.Linear] == ["lm_head"]
    pack_linears(model)
    assert model.lm_head.blocks.type_name == "Q8_0"


def test_fused_projections_join_their_blocks_and_changed_weights_drop_them(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [_blocks("Q4_1", n, 64, seed=n) for n in (32, 16, 16)]
    linears = []
    for b in parts:
        lin = nn.Linear(64, b.shape[0], bias=False)
        lin.weight = nn.Parameter(b.dequantize(), requires_grad=False)
        assert GGUFBlocksForm.attach(lin, b)
        linears.append(lin)
    merged = concat_linears(linears)
    joined = GGUFBlocksForm.of(merged)
    assert joined is not None and joined.shape == (64, 64)
    assert torch.equal(joined.dequantize(), merged.weight)
    with torch.no_grad():
        merged.weight.mul_(2)  # SmoothQuant scales weights in place: the blocks are no longer this weight
    assert GGUFBlocksForm.of(merged) is None
    linears[0].weight.data = linears[0].weight.data.clone()  # GPTQ swaps the data: also dropped
    assert GGUFBlocksForm.of(linears[0]) is None
    wrong = nn.Linear(64, 8, bias=False)
    assert not GGUFBlocksForm.attach(wrong, parts[0])  # [32, 64] blocks for an [8, 64] weight: refused
    # A packed model keeps only blocks that are still its weights.
    model = nn.Sequential(linears[1], merged)
    pack_linears(model)
    assert model[0].blocks is not None and model[1].blocks is None
    x = torch.randn(3, 64)
    calls: list[int] = []
    monkeypatch.setattr(packed_linear, "gguf_linear", lambda a, b: calls.append(1) or gguf_linear(a, b))
    torch.testing.assert_close(model[0](x), x @ linears[1].weight.T, rtol=1e-5, atol=1e-5)
    assert not calls  # outside a runner's decode step: the packed GEMM
    with gguf_kernel_scope(True):
        torch.testing.assert_close(model[0](x), x @ linears[1].weight.T, rtol=1e-5, atol=1e-5)
        more = packed_linear.GGUF_KERNEL_MAX_ROWS + 1
        assert model[0](torch.randn(more, 64)).shape == (more, 16)  # more rows: packed again
    assert calls == [1]
    # Without the C++ kernels the blocks stay unused: gguf_linear's torch form dequantizes the weight per call.
    monkeypatch.setattr(cpu_kernels, "cpu_ops", lambda: None)
    with gguf_kernel_scope(True):
        torch.testing.assert_close(model[0](x), x @ linears[1].weight.T, rtol=1e-5, atol=1e-5)
    assert calls == [1]


def test_packed_linear_refuses_blocks_of_another_shape() -> None:
    b = _blocks("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="GGUF blocks"):
        PackedLinear(torch.zeros(8, 64), b)



def test_a_q4_k_gguf_runs_small_steps_on_its_super_blocks(gguf_path: str, alpaca_instructions: list[str],
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K, the K-quant of most Q4_K_M files: a tiny Llama GGUF whose projections are Q4_K (random super-blocks,
    written as llama.cpp lays them out) keeps them as blocks, and its greedy tokens are the packed GEMMs'; a bf16
    load of it holds no blocks."""
    import gguf
    import transformers
    from llama_family_models import write_gguf

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    quantized = {}
    for i in range(2):
        for name, (n, k) in {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256),
                             "attn_output": (256, 256), "ffn_gate": (512, 256), "ffn_up": (512, 256),
                             "ffn_down": (256, 512)}.items():
            nsb = n * k // 256
            raw = rng.integers(0, 256, size=(nsb, 144), dtype=np.uint8)
            raw[:, 0:2] = rng.normal(0, 2e-4, nsb).astype(np.float16).view(np.uint8).reshape(nsb, 2)
            raw[:, 2:4] = np.abs(rng.normal(0, 2e-4, nsb)).astype(np.float16).view(np.uint8).reshape(nsb, 2)
            quantized[f"blk.{i}.{name}.weight"] = (raw.reshape(n, -1), gguf.GGMLQuantizationType.Q4_K)
    path = tmp_path / "q4k.gguf"
    write_gguf(path, "llama", model, gguf_path, quantized=quantized)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    engine = LLMEngine.from_model(str(path), EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))
    layer = engine.runner.model.layers[1]
    assert layer.self_attn.qkv_proj.blocks.type_name == "Q4_K" and layer.mlp.down_proj.blocks.type_name == "Q4_K"
    assert engine.runner.model.lm_head.blocks is None  # an F32 tensor: nothing to keep
    bf16 = open_model(str(path), torch.bfloat16, CPU, tokenizer=False).model  # only the fp32 path reads blocks
    assert GGUFBlocksForm.of(bf16.layers[0].mlp.down_proj) is None
    assert not [m for m in bf16.modules() if isinstance(m, GGUFBlocksHolder)]
    calls: list[int] = []
    kernel = packed_linear.gguf_linear
    monkeypatch.setattr(packed_linear, "gguf_linear", lambda x, b: calls.append(x.shape[0]) or kernel(x, b))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    on_blocks = [o.output_token_ids for o in engine.generate(alpaca_instructions[:3], params)]
    assert calls
    monkeypatch.setenv("TOKENMILL_GGUF_KERNEL", "0")  # read at each step (gguf_kernel_max_rows)
    engine.reset_prefix_cache()
    assert [o.output_token_ids for o in engine.generate(alpaca_instructions[:3], params)] == on_blocks
