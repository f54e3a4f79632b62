"""Every family of engine.model.architectures runs exactly as HF transformers does, from a Hugging Face folder and from
GGUF, and what tokenmill does not implement is an error before any work (issue 27).

Per family: a tiny random-weight model built by HF transformers from the family's own config class (2 layers, GQA,
its special fields switched on: Llama 3 RoPE scaling with a short original context so it matters, Qwen2 QKV bias
with YaRN, Qwen3 q/k norms with head_dim != hidden / heads, Mistral with linear RoPE scaling), saved with
save_pretrained (safetensors) beside the real SmolLM2 tokenizer, and written as GGUF in the layout llama.cpp's
convert_hf_to_gguf.py writes (permuted Q/K for llama/mistral, rope_freqs for Llama 3). Greedy generation in fp32
on 16 real prompts x 32 tokens is token-identical to HF from both formats: HF's argmax at every output position given
the prompt and our earlier tokens is our token (teacher forcing, one HF forward per prompt; by induction over the
positions that is HF's greedy output, as test_hf_parity.py argues), and HF's own `generate` loop gives the same
tokens on the first prompt (HF `generate` on all 16 prompts took a family's test from 5.0 to 7.9 CPU-s, AVX2
EPYC).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from family_models import chat_prompt_ids

from engine import LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from llama_family_models import (  # noqa: E402  (tests/engine, on sys.path through tests/engine/conftest.py)
    FAMILIES,
    FP32,
    MAX_TOKENS,
    build_family,
    copy_folder,
    edit_config,
    hf_argmax,
    hf_greedy,
    our_greedy,
    write_gguf,
)

NUM_PROMPTS = 16


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory, gguf_path: str, hf_tok) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_family(root, f, gguf_path, hf_tok) for f in FAMILIES}


@pytest.fixture(scope="module")
def prompt_ids(hf_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    return chat_prompt_ids(hf_tok, gsm8k_questions, alpaca_instructions, NUM_PROMPTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_from_folder_and_gguf(family: str, families, prompt_ids) -> None:
    model, folder, path = families[family]
    ours = our_greedy(str(folder), prompt_ids)
    assert all(len(r) == MAX_TOKENS for r in ours)
    assert all(len(set(r)) >= 4 for r in ours), "degenerate random model: raise the init scale"
    assert len({t for r in ours for t in r}) > 60
    assert hf_argmax(model, prompt_ids, ours) == ours
    assert hf_greedy(model, prompt_ids[:1]) == ours[:1]
    assert our_greedy(str(path), prompt_ids) == ours


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_close_to_hf(family: str, families, prompt_ids) -> None:
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence

    model, folder, path = families[family]
    ids = torch.tensor(prompt_ids[0])
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
        for cfg, ours, *_ in (open_model(str(folder), torch.float32, torch.device("cpu"), tokenizer=False),
                              open_model(str(path), torch.float32, torch.device("cpu"), tokenizer=False)):
            assert cfg.architecture in (family, "llama")
            logits = ours.compute_logits(forward_sequence(ours, ids))
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=2e-4)


def test_config_fields(families) -> None:
    """Each family's special fields reach ModelConfig, from both formats; generation_config's EOS list too. The GGUFs
    are read as the engine reads them (engine.loading.gguf_file.open_gguf: gguf.GGUFReader's fields, parsed about 12x
    faster; test_weights_cache.py checks that the fields are the same), and the CLI's header-only reader gives the same
    config (engine.loading.gguf_header.GGUFHeader: Llama 3's rope_freqs read from the file's data)."""
    from engine.loading.gguf_file import open_gguf, read_gguf_config
    from engine.loading.gguf_header import GGUFHeader
    from engine.loading.hf_folder import read_hf_config

    hf = {f: read_hf_config(str(families[f][1])) for f in FAMILIES}
    gg = {f: read_gguf_config(open_gguf(str(families[f][2]))) for f in FAMILIES}
    assert {f: read_gguf_config(GGUFHeader(str(families[f][2]))) for f in FAMILIES} == gg
    assert hf["llama"].rope_scaling.rope_type == "llama3" and hf["llama"].eos_token_ids == (2, 0)
    assert gg["llama"].rope_scaling.freq_factors is not None
    assert hf["qwen2"].qkv_bias and gg["qwen2"].qkv_bias and hf["qwen2"].tie_word_embeddings
    assert hf["qwen2"].rope_scaling.rope_type == gg["qwen2"].rope_scaling.rope_type == "yarn"
    assert hf["qwen3"].qk_norm and gg["qwen3"].qk_norm and hf["qwen3"].head_dim == gg["qwen3"].head_dim == 32
    assert hf["mistral"].architecture == "mistral"
    assert hf["mistral"].sliding_window == gg["mistral"].sliding_window == 24
    assert hf["mistral"].rope_scaling.rope_type == gg["mistral"].rope_scaling.rope_type == "linear"
    assert not hf["llama"].qkv_bias and not hf["llama"].qk_norm


def test_stops_on_every_eos_id(families, prompt_ids) -> None:
    """A token of generation_config.json's eos_token_id list ends a request, not only the tokenizer's EOS."""
    _, folder, _ = families["llama"]
    engine = LLMEngine.from_model(str(folder), FP32)
    first = engine.generate(prompt_ids[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop = first.output_token_ids[3]
    cfg = engine.model_config
    assert engine.scheduler.eos_token_ids == {2, 0}
    engine.scheduler.eos_token_ids = frozenset({stop})  # as if the model file listed this token
    out = engine.generate(prompt_ids[:1], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.output_token_ids[-1] == stop and cfg.eos_token_ids == (2, 0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_quantized_paths_stay_close(family: str, families, prompt_ids, tmp_path: Path) -> None:
    """INT8, INT4 (on load and `tokenmill quantize` folders, RTN and bf16) and the weights cache run a model with
    QKV bias / q-k norms and stay close to fp32 (next-token logits of a real prompt)."""
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence
    from engine.ptq.to_folder import quantize_to_folder
    from engine.quant.int8_linear import int8_available

    _, folder, path = families[family]
    ids = torch.tensor(prompt_ids[1])
    cpu = torch.device("cpu")

    def logits(model: str, quantization: str, loaded=None) -> torch.Tensor:
        # the tokenizer only where the load needs it: int8's SmoothQuant calibrates on text
        loaded = loaded or open_model(model, torch.float32, cpu, quantization=quantization, group_size=32,
                                      tokenizer=quantization == "int8")
        with torch.no_grad():
            if quantization == "int8":
                loaded.model.fuse_projections()
            return loaded.model.compute_logits(forward_sequence(loaded.model, ids))

    def close(got: torch.Tensor, want: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()

    ref = logits(str(folder), "none")
    q4, q16 = tmp_path / "q4", tmp_path / "q16"
    quantize_to_folder(str(folder), str(q4), bits=4, group_size=32)
    quantize_to_folder(str(folder), str(q16), bits=16)
    # the INT4 kernels (Int4Linear + AddBias, fused QKV) against the same INT4 weights dequantized into nn.Linear:
    # only rounding apart, so a dropped bias or q/k norm would show
    assert close(logits(str(q4), "auto"), logits(str(q4), "none")) > 0.9999
    assert close(logits(str(path), "none"), ref) > 0.9999  # GGUF == folder
    assert close(logits(str(q16), "auto"), ref) > 0.99  # bf16 weights, biases and norms fp32
    if int8_available():  # W8A8 of random weights is noisy too; the bias must ride along the INT8 GEMM
        int8 = open_model(str(folder), torch.float32, cpu, quantization="int8")
        qkv = int8.model.layers[0].self_attn.qkv_proj  # as loaded (fused on load), before the forward below
        assert close(logits(str(folder), "int8", int8), ref) > 0.75
        from safetensors.torch import load_file

        from engine.quant.state import AddBias

        if family == "qwen2":
            want = load_file(folder / "model.safetensors")
            want = torch.cat([want[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
            assert isinstance(qkv, AddBias) and type(qkv.inner).__name__ == "Int8Linear"
            torch.testing.assert_close(qkv.bias.detach(), want)
        else:
            assert not isinstance(qkv, AddBias)
    # INT4 of random N(0, 0.15) weights is noisy; near, not equal
    for model in (str(folder), str(path)):
        assert close(logits(model, "int4"), ref) > 0.8


def test_rope_inv_freq_matches_transformers() -> None:
    """rope_inv_freq equals transformers' ROPE_INIT_FUNCTIONS for every type we run (dynamic past the context)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.layers.rope import rope_inv_freq
    from engine.model.hf_config import config_from_hf

    scalings = [{"rope_type": "linear", "factor": 4.0},
                {"rope_type": "dynamic", "factor": 2.0},
                {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16.0},
                {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.7,
                 "mscale_all_dim": 1.0, "truncate": False},
                {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}]
    for rs in scalings:
        hf_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                          num_hidden_layers=1, intermediate_size=64, vocab_size=32,
                                          max_position_embeddings=1024, rope_theta=500000.0, rope_scaling=dict(rs))
        cfg = config_from_hf(hf_cfg.to_dict())
        want, want_factor = ROPE_INIT_FUNCTIONS[rs["rope_type"]](hf_cfg, torch.device("cpu"))
        got, factor = rope_inv_freq(cfg)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert factor == pytest.approx(want_factor)
        if rs["rope_type"] == "dynamic":
            long, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_cfg, torch.device("cpu"), seq_len=3000)
            per_pos, _ = rope_inv_freq(cfg, torch.tensor([10, 2999]))
            torch.testing.assert_close(per_pos[0], want, rtol=1e-6, atol=0)
            torch.testing.assert_close(per_pos[1], long, rtol=1e-5, atol=0)


# ---- never silently wrong ---------------------------------------------------------------------------------------

def test_extra_tensor_is_an_error(families, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from engine.loading.hf_folder import check_hf_folder

    bad = copy_folder(families["qwen2"][1], tmp_path)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj\.bias.*qwen2"):
        check_hf_folder(str(bad))
    with pytest.raises(ValueError, match=r"o_proj\.bias"):
        LLMEngine.from_model(str(bad), FP32)


def test_extra_gguf_tensor_is_an_error(families, gguf_path: str, tmp_path: Path) -> None:
    """A llama GGUF with Q biases (which llama as we run it has not) fails naming the tensor, before any read."""
    model = families["mistral"][0]
    bad = tmp_path / "bias.gguf"
    write_gguf(bad, "mistral", model, gguf_path, extra={"blk.0.attn_q.bias": np.zeros(64, np.float32)})
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.bias.*llama"):
        LLMEngine.from_model(str(bad), FP32)


@pytest.mark.parametrize(("change", "match"), [
    ({"model_type": "falcon"}, r"'falcon' is not supported; tokenmill runs llama \(llama, mistral\), qwen2"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, r"rope_scaling type 'longrope' is not implemented"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64, "beta_x": 1}}, r"rope_scaling has fields \['beta_x'\]"),
    ({"attention_bias": True}, r"attention_bias=True"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"num_experts": 8}, r"num_experts"),
])
def test_unsupported_config_is_an_error(change: dict, match: str, families, tmp_path: Path) -> None:
    from engine.loading.hf_folder import check_hf_folder

    bad = copy_folder(families["llama"][1], tmp_path)
    edit_config(bad, rope_parameters=None, **change)
    with pytest.raises(ValueError, match=match):
        check_hf_folder(str(bad))


def test_qwen_per_layer_window_is_an_error(families, tmp_path: Path) -> None:
    from engine.loading.hf_folder import read_hf_config

    folder = copy_folder(families["qwen2"][1], tmp_path)
    edit_config(folder, use_sliding_window=True, sliding_window=16, max_window_layers=1, layer_types=None)
    with pytest.raises(ValueError, match="sliding window on some layers only"):
        read_hf_config(str(folder))
    edit_config(folder, max_window_layers=0)
    assert read_hf_config(str(folder)).sliding_window == 16


def test_nan_weights_are_an_error(families, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    bad = copy_folder(families["qwen3"][1], tmp_path)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight holds NaN"):
        LLMEngine.from_model(str(bad), FP32)


def test_sharded_folder_loads(families, prompt_ids, tmp_path: Path) -> None:
    """A folder sharded with model.safetensors.index.json loads to the same greedy output."""
    model, folder, _ = families["qwen3"]
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="600KB")
    assert (out / "model.safetensors.index.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / f, out / f)
    assert our_greedy(str(out), prompt_ids[:4]) == our_greedy(str(folder), prompt_ids[:4])
