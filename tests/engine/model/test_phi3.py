"""Phi-3 / Phi-4 (`phi3`) runs exactly as HF transformers does, from a Hugging Face folder and from GGUF (issue 43).

The tiny random model (tests/engine/family_models.py) has Phi-3's fused qkv_proj and gate_up_proj, a sliding window
of 28 tokens and LongRoPE with an original context of 32 tokens: every real prompt is longer, so HF's forward uses the
long factors and the attention factor, as the engine does (test_longrope_rows.py: rows within the original context,
the short factors). The short factors are checked against transformers' own LongRoPE frequencies. The GGUF
is written as llama.cpp's converter writes Phi-3 (attn_qkv, ffn_up of twice the width, rope_factors_long/_short),
also with those fused tensors in Q4_0, which the loader splits as packed INT4 and as GGUF blocks.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

MAX_TOKENS = 32
FP32 = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=16,
                    max_num_batched_tokens=512)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory, family_tok, tok_fields) -> tuple:
    """(HF model fp32, HF folder, GGUF file, GGUF file with attn_qkv / ffn_up / attn_output in Q4_0)."""
    from family_models import build_hf, save_folder, write_gguf

    root = tmp_path_factory.mktemp("phi3")
    model = build_hf("phi3", len(family_tok))
    folder = save_folder(model, root / "phi3", family_tok)
    write_gguf(root / "phi3.gguf", "phi3", model, tok_fields)
    write_gguf(root / "phi3-q4.gguf", "phi3", model, tok_fields, q4_0=("attn_qkv", "ffn_up", "attn_output"))
    return model, folder, root / "phi3.gguf", root / "phi3-q4.gguf"


def _ours(model: str | LLMEngine, prompt_ids: list[list[int]], config: EngineConfig = FP32) -> list[list[int]]:
    """Greedy MAX_TOKENS tokens per prompt of a model path (loaded with `config`) or of a loaded engine."""
    engine = model if isinstance(model, LLMEngine) else LLMEngine.from_model(model, config)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def test_greedy_matches_hf_from_folder_and_gguf(phi3, family_prompts) -> None:
    from family_models import hf_argmax, hf_generate

    model, folder, path, _ = phi3
    orig = model.config.rope_parameters["original_max_position_embeddings"]
    assert min(len(p) for p in family_prompts) > max(orig, model.config.sliding_window)
    ours = _ours(str(folder), family_prompts)
    assert all(len(r) == MAX_TOKENS for r in ours)
    assert all(len(set(r)) >= 4 for r in ours), "degenerate random model: change the init"
    assert len({t for r in ours for t in r}) > 60
    assert hf_argmax(model, family_prompts, ours) == ours
    assert hf_generate(model, family_prompts[:1], MAX_TOKENS) == ours[:1]
    assert _ours(str(path), family_prompts) == ours


def test_logits_close_to_hf(phi3, family_prompts) -> None:
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence

    model, folder, path, _ = phi3
    ids = torch.tensor(family_prompts[0])
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
        for cfg, ours, *_ in (open_model(str(folder), torch.float32, CPU, tokenizer=False),
                              open_model(str(path), torch.float32, CPU, tokenizer=False)):
            assert cfg.architecture == "phi3"
            torch.testing.assert_close(ours.compute_logits(forward_sequence(ours, ids)), ref, rtol=1e-4, atol=2e-4)


def test_config_fields(phi3) -> None:
    """LongRoPE's factors, original context and attention factor, and the window, from both formats (the GGUF's the
    same through the CLI's header-only reader)."""
    from engine.loading.gguf_file import open_gguf, read_gguf_config
    from engine.loading.gguf_header import GGUFHeader
    from engine.loading.hf_folder import read_hf_config

    model, folder, path, _ = phi3
    rope = model.config.rope_parameters
    hf, gg = read_hf_config(str(folder)), read_gguf_config(open_gguf(str(path)))
    assert read_gguf_config(GGUFHeader(str(path))) == gg
    for cfg in (hf, gg):
        rs = cfg.rope_scaling
        assert (rs.rope_type, rs.original_max_position_embeddings, rs.factor) == ("longrope", 32, 2048 / 32)
        assert rs.long_factor == pytest.approx(rope["long_factor"])
        assert rs.short_factor == pytest.approx(rope["short_factor"])
        assert cfg.sliding_window == 28 and not cfg.tie_word_embeddings and cfg.hidden_act == "silu"
    assert hf.rope_scaling.attention_factor is None  # computed as transformers does; the GGUF stores it
    assert gg.rope_scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(64) / math.log(32)))


def test_longrope_frequencies_match_transformers() -> None:
    """rope_inv_freq's LongRoPE equals transformers' for the short factors (a context within the original one) and
    the long ones (past it), with the same attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rope import rope_inv_freq
    from engine.model.hf_config import config_from_hf

    for attention_factor in (None, 1.3):
        rs = {"type": "su", "original_max_position_embeddings": 4096,
              "short_factor": [1.0 + 0.1 * i for i in range(32)], "long_factor": [1.0 + 0.9 * i for i in range(32)]}
        if attention_factor is not None:
            rs["attention_factor"] = attention_factor
        hf_cfg = transformers.Phi3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                         num_hidden_layers=1, intermediate_size=64, vocab_size=32,
                                         max_position_embeddings=16384, original_max_position_embeddings=4096,
                                         rope_theta=10000.0, rope_scaling=rs)
        cfg = config_from_hf(hf_cfg.to_dict())
        for context, seq_len in ((4096, None), (8192, 4097)):
            want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, CPU, seq_len=seq_len)
            got, factor = rope_inv_freq(cfg, max_positions=context)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
            assert factor == pytest.approx(want_factor)


def test_fused_q4_gguf_splits_packed_int4_and_blocks(phi3, family_prompts) -> None:
    """Q4_0 attn_qkv / ffn_up split on load as packed INT4 (quantization auto) and as GGUF blocks (the fp32 load
    keeps them for the small-batch kernel): both compute what the dequantized weights do."""
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence
    from engine.quant.forms import GGUFBlocksForm

    q4 = str(phi3[3])
    ids = torch.tensor(family_prompts[2])
    with torch.no_grad():
        plain = open_model(q4, torch.float32, CPU, quantization="none", tokenizer=False).model
        layer = plain.layers[0]
        assert all(GGUFBlocksForm.of(m) is not None for m in (layer.self_attn.q_proj, layer.self_attn.v_proj,
                                                               layer.mlp.gate_proj, layer.mlp.up_proj))
        assert GGUFBlocksForm.of(layer.mlp.down_proj) is None  # F32 in the file
        ref = plain.compute_logits(forward_sequence(plain, ids))
        native = open_model(q4, torch.float32, CPU, quantization="auto", tokenizer=False).model
        assert type(native.layers[0].self_attn.k_proj).__name__ == "Int4Linear"
        got = native.compute_logits(forward_sequence(native, ids))
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.9999
    assert _ours(q4, family_prompts[:4]) == _ours(q4, family_prompts[:4], EngineConfig(**{**FP32.__dict__,
                                                                                          "quantization": "auto"}))


def test_quantized_loads_split_alike(phi3, family_prompts, tmp_path: Path) -> None:
    """INT4 on load gives the same model from the folder's qkv_proj / gate_up_proj and the GGUF's attn_qkv / ffn_up
    (one RTN of the same split weights); the INT4 kernels compute what those INT4 weights dequantized do (a
    `tokenmill quantize` folder, auto against none); INT8 stays close to fp32. (INT4 of this tiny random model is
    too noisy for a bound against fp32 to mean anything: cosine 0.4-0.6.)"""
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence
    from engine.ptq.to_folder import quantize_to_folder
    from engine.quant.int8_linear import int8_available

    _, folder, path, _ = phi3
    ids = torch.tensor(family_prompts[1])

    def logits(model: str, quantization: str) -> torch.Tensor:
        # the tokenizer only where the load needs it: int8's SmoothQuant calibrates on text
        loaded = open_model(model, torch.float32, CPU, quantization=quantization, group_size=32,
                            tokenizer=quantization == "int8").model
        with torch.no_grad():
            loaded.fuse_projections()
            return loaded.compute_logits(forward_sequence(loaded, ids))

    def close(got: torch.Tensor, want: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()

    assert close(logits(str(folder), "int4"), logits(str(path), "int4")) > 0.9999
    q4 = tmp_path / "q4"
    quantize_to_folder(str(folder), str(q4), bits=4, group_size=32)
    assert close(logits(str(q4), "auto"), logits(str(q4), "none")) > 0.9999
    if int8_available():
        assert close(logits(str(folder), "int8"), logits(str(folder), "none")) > 0.95


@pytest.mark.parametrize(("change", "match"), [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     r"partial_rotary_factor 1\.5 must be a number in \(0, 1\]"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope_scaling type 'yarn' is not implemented for phi3"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
])
def test_unsupported_phi3_config_is_an_error(change: dict, match: str, phi3, tmp_path: Path) -> None:
    from engine.loading.hf_folder import check_hf_folder

    bad = tmp_path / "bad"
    shutil.copytree(phi3[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        check_hf_folder(str(bad))


@pytest.fixture(scope="module")
def phi4mini(tmp_path_factory: pytest.TempPathFactory, family_tok, tok_fields) -> tuple:
    """Phi-4-mini's partial rotary (partial_rotary_factor 0.75: 12 of 16 dims rotate) with LongRoPE and tied
    embeddings: (HF model fp32, HF folder, GGUF file)."""
    from family_models import build_hf, save_folder, write_gguf

    root = tmp_path_factory.mktemp("phi4mini")
    model = build_hf("phi4mini", len(family_tok))
    folder = save_folder(model, root / "phi4mini", family_tok)
    write_gguf(root / "phi4mini.gguf", "phi4mini", model, tok_fields)
    return model, folder, root / "phi4mini.gguf"


def test_partial_rotary_greedy_matches_hf(phi4mini, family_prompts, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens of the partial-rotary model equal HF's, from the folder and the GGUF, through the C++ fused
    RoPE-and-KV-write kernel and through the torch path (fused ops off); the config reads rotary_dim 12 from both."""
    from family_models import hf_argmax, hf_generate

    from engine.layers import mlp, self_attn
    from engine.loading.gguf_file import open_gguf, read_gguf_config
    from engine.loading.hf_folder import read_hf_config

    model, folder, path = phi4mini
    for cfg in (read_hf_config(str(folder)), read_gguf_config(open_gguf(str(path)))):
        assert (cfg.head_dim, cfg.rotary_dim, len(cfg.rope_scaling.long_factor)) == (16, 12, 6)
    prompts = family_prompts[:8]
    engine = LLMEngine.from_model(str(folder), FP32)
    ours = _ours(engine, prompts)
    assert all(len(set(r)) >= 4 for r in ours), "degenerate random model: change the init"
    assert hf_argmax(model, prompts, ours) == ours
    assert hf_generate(model, prompts[:1], MAX_TOKENS) == ours[:1]
    assert _ours(str(path), prompts) == ours
    for module in (self_attn, mlp):  # the attention and MLP blocks' fused ops, looked up at each forward
        monkeypatch.setattr(module, "fused_ops", lambda x: None)
    assert _ours(engine.with_config(FP32), prompts[:4]) == ours[:4]  # the same weights, a fresh KV pool


def test_partial_rotary_is_refused_where_the_family_does_not_read_it() -> None:
    from engine.model.hf_config import config_from_hf

    llama = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        config_from_hf({**llama, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not implemented for llama"):
        config_from_hf({**llama, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})


def test_unfused_tensor_in_a_phi3_folder_is_an_error(phi3, tmp_path: Path) -> None:
    """Phi-3 files hold fused projections: a separate q_proj beside qkv_proj is named, before any work."""
    from safetensors.torch import load_file, save_file

    from engine.loading.hf_folder import check_hf_folder

    bad = tmp_path / "bad"
    shutil.copytree(phi3[1], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.weight.*phi3"):
        check_hf_folder(str(bad))
