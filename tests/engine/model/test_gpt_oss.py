"""gpt-oss (`gpt_oss`) runs exactly as HF transformers does from a Hugging Face folder, unquantized and with MXFP4
experts, and what tokenmill does not implement of it is an error before any work (issue 43).

A tiny random-weight model built by HF transformers from GptOssConfig (tests/engine/gpt_oss_models.py: fp32, eager
attention): 2 layers (the first sliding with a window of 16 tokens, shorter than every prompt, the second full), 4
query / 2 KV heads, YaRN, 8 experts of which 2 per token, a SwiGLU clamp of 2.0 (so it bites), random biases and
sinks; saved with save_pretrained beside the real SmolLM2 tokenizer. The MXFP4 folder holds the same model with its
expert weights as `_blocks` / `_scales` in OpenAI's published layout (gpt_oss_models.quantize_mxfp4: round to
nearest on the FP4 grid, one power of two per 32 values) and `quantization_config.quant_method` "mxfp4";
transformers itself loads that folder (dequantizing on the CPU) as the reference. Its GGUF files:
test_gpt_oss_gguf.py. Greedy tokens on real prompts equal HF's (teacher-forced argmax at
every position, and HF's own `generate` on the first prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_models import chat_prompt_ids
from family_models import hf_argmax as _hf_argmax
from gpt_oss_models import WINDOW, build_gpt_oss, write_mxfp4_folder
from llama_family_models import FP32, MAX_TOKENS
from llama_family_models import hf_greedy as _hf_greedy
from llama_family_models import our_greedy as _ours

transformers = pytest.importorskip("transformers")

NUM_PROMPTS = 4


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory, hf_tok) -> tuple[object, Path, object, Path]:
    """(HF model, its folder, HF's model of the MXFP4 folder, the MXFP4 folder)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    model = build_gpt_oss(len(hf_tok), swiglu_limit=2.0, seed=43)
    folder, mx_folder = root / "gpt_oss", root / "gpt_oss_mxfp4"
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    write_mxfp4_folder(folder, mx_folder)
    mx_model = transformers.AutoModelForCausalLM.from_pretrained(
        mx_folder, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    return model, folder, mx_model, mx_folder


@pytest.fixture(scope="module")
def prompt_ids(hf_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    return chat_prompt_ids(hf_tok, gsm8k_questions, alpaca_instructions, NUM_PROMPTS)


def test_greedy_matches_hf_from_folder(gpt_oss, prompt_ids) -> None:
    """Both CPU attention paths (the C++ kernel and the torch reference) give HF's greedy tokens on prompts longer
    than the window."""
    from dataclasses import replace

    model, folder, _, _ = gpt_oss
    assert min(len(p) for p in prompt_ids) > 2 * WINDOW
    ours = _ours(str(folder), prompt_ids, replace(FP32, attention_backend="cpu"))
    assert all(len(r) == MAX_TOKENS for r in ours)
    assert all(len(set(r)) >= 4 for r in ours), "degenerate random model: raise the init scale"
    assert _hf_argmax(model, prompt_ids, ours) == ours
    assert _hf_greedy(model, prompt_ids[:1]) == ours[:1]
    assert _ours(str(folder), prompt_ids, replace(FP32, attention_backend="torch")) == ours


def test_mxfp4_folder_matches_hf(gpt_oss, prompt_ids) -> None:
    """The MXFP4 experts dequantize exactly as transformers' own dequantize does, and the MXFP4 folder's greedy
    tokens equal those of HF's model of that folder (and differ from the unquantized model's: the blocks are read)."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.loading.gpt_oss_tensors import dequantize_mxfp4

    model, folder, mx_model, mx_folder = gpt_oss
    tensors = load_file(mx_folder / "model.safetensors")
    for proj in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{proj}"
        blocks, scales = tensors[f"{key}_blocks"], tensors[f"{key}_scales"]
        want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), want)
        assert torch.equal(mx_model.get_parameter(key), want)
    ours = _ours(str(mx_folder), prompt_ids)
    assert _hf_argmax(mx_model, prompt_ids, ours) == ours
    assert ours != _ours(str(folder), prompt_ids)


def test_unpacked_experts_match_hf_logits(gpt_oss, prompt_ids) -> None:
    """The experts' torch path (stacked weights with their biases, as on CUDA or without oneDNN; the engine above
    runs oneDNN-packed ones with the biases added after), unfused and fused, gives HF's logits."""
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence

    model, folder, _, _ = gpt_oss
    ids = torch.tensor(prompt_ids[0])
    with torch.no_grad():
        want = model(ids[None]).logits[0]
        ours = open_model(str(folder), torch.float32, torch.device("cpu"), tokenizer=False).model
        for fused in (False, True):
            if fused:
                assert ours.fuse_projections() > 0
            assert ours.layers[0].mlp.experts.gemms is None
            torch.testing.assert_close(ours.compute_logits(forward_sequence(ours, ids)), want, rtol=1e-4, atol=1e-4)


def test_attention_sinks_kernel_matches_reference() -> None:
    """The C++ kernel's sinks equal the torch reference's on decodes and prefill chunks, with and without a window;
    sinks change the output, and without them the kernel is unchanged."""
    from attention_steps import make_step

    from engine.kernels.cpu_kernels import cpu_ops
    from engine.layers.attention import paged_attention_cpu, paged_attention_ref

    if cpu_ops() is None:
        pytest.skip("the CPU kernels do not build here")
    q, k_cache, v_cache, meta = make_step([1, 1, 9, 30], [40, 17, 9, 50], 8, 2, 16, torch.float32)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2
    for window in (None, 20):
        want = paged_attention_ref(q, k_cache, v_cache, meta, 0.125, sliding_window=window, sinks=sinks)
        got = paged_attention_cpu(q, k_cache, v_cache, meta, 0.125, sliding_window=window, sinks=sinks)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        plain = paged_attention_cpu(q, k_cache, v_cache, meta, 0.125, sliding_window=window)
        assert not torch.allclose(plain, got, atol=1e-3)
        torch.testing.assert_close(plain, paged_attention_ref(q, k_cache, v_cache, meta, 0.125, sliding_window=window),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sinks must be"):
        paged_attention_ref(q, k_cache, v_cache, meta, 0.125, sinks=sinks[:4])


def test_config_fields_and_refusals(gpt_oss) -> None:
    """config.json's gpt-oss fields reach ModelConfig; what tokenmill does not run is an error naming it."""
    from engine.config import ModelConfig
    from engine.loading.hf_folder import read_hf_config
    from engine.loading.hf_quantized import read_quant_format
    from engine.model.architectures import describe, gguf_architecture
    from engine.model.hf_config import config_from_hf
    from engine.model.registry import build_model
    from engine.worker.model_runner import ModelRunner

    _, folder, _, mx_folder = gpt_oss
    cfg = read_hf_config(str(folder))
    assert (cfg.attention_sinks, cfg.o_bias, cfg.expert_bias, cfg.qkv_bias) == (True, True, True, True)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.router, cfg.num_experts, cfg.num_experts_per_tok) == (
        2.0, 1.702, "topk_softmax", 8, 2)
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == WINDOW
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.truncate is False
    assert read_hf_config(str(mx_folder)) == cfg
    assert describe(cfg).startswith("gpt_oss, 2 layers, hidden 64, 8 experts (2 active")
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf({**raw, "attention_bias": False})
    with pytest.raises(ValueError, match="mxfp4"):  # MXFP4 is read for gpt-oss's experts only
        read_quant_format({"model_type": "llama", "quantization_config": {"quant_method": "mxfp4"}}, "x")
    assert gguf_architecture("gpt-oss", True).name == "gpt_oss"  # its GGUF files: test_gpt_oss_gguf.py
    small = ModelConfig(**{**cfg.__dict__, "vocab_size": 32})
    with pytest.raises(ValueError, match="attention sinks"):  # e.g. the Triton kernels: refused before any step
        ModelRunner(build_model(small, 8), small, 4, 16, torch.device("cpu"), torch.float32,
                    attn_fn=lambda *a, **k: None)
