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

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[3]
NUM_PROMPTS = 16
MAX_TOKENS = 32
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def _hf_config(family: str, vocab: int):
    """The family's HF config with its special fields on."""
    if family == "llama":
        return transformers.LlamaConfig(vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=False, **SHAPE,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if family == "qwen2":
        return transformers.Qwen2Config(vocab_size=vocab, rope_theta=1e6, tie_word_embeddings=True,
                                        use_sliding_window=False, **SHAPE,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if family == "qwen3":
        return transformers.Qwen3Config(vocab_size=vocab, rope_theta=1e6, head_dim=32, tie_word_embeddings=False,
                                        use_sliding_window=False, **SHAPE)
    if family == "mistral":
        # A window shorter than every chat-templated prompt: the attention paths must apply it
        # (engine.layers.attention).
        return transformers.MistralConfig(vocab_size=vocab, rope_theta=1e6, sliding_window=24, head_dim=16,
                                          tie_word_embeddings=False, **SHAPE,
                                          rope_scaling={"rope_type": "linear", "factor": 2.0})
    raise AssertionError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotate-half Q/K rows to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama 3's rope_freqs."""
    rs = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rs["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old, low, high, factor = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                              rs["high_freq_factor"], rs["factor"])
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


_TOKENIZER_FIELDS: dict[str, list] = {}


def _tokenizer_fields(tokenizer_gguf: str) -> list:
    """(key, value, type, sub_type) of every tokenizer.* field of a GGUF file (read once: seconds)."""
    if tokenizer_gguf not in _TOKENIZER_FIELDS:
        reader = gguf.GGUFReader(tokenizer_gguf)
        _TOKENIZER_FIELDS[tokenizer_gguf] = [
            (name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
            for name, f in reader.fields.items() if name.startswith("tokenizer.")]
    return _TOKENIZER_FIELDS[tokenizer_gguf]


def write_gguf(path: Path, family: str, model, tokenizer_gguf: str, extra: dict[str, np.ndarray] | None = None,
               quantized: dict[str, tuple[np.ndarray, object]] | None = None) -> None:
    """The model as llama.cpp's converter writes it (F32 tensors), with the tokenizer fields of `tokenizer_gguf`;
    `quantized` (GGUF name -> (raw bytes [N, row bytes], gguf.GGMLQuantizationType)) replaces those tensors."""
    cfg = model.config
    arch = GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    rs = cfg.rope_parameters
    if rs.get("rope_type") in ("linear", "yarn"):
        kind = gguf.RopeScalingType.LINEAR if rs["rope_type"] == "linear" else gguf.RopeScalingType.YARN
        w.add_rope_scaling_type(kind)
        w.add_rope_scaling_factor(rs["factor"])
        if rs["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    for name, value, vtype, sub in _tokenizer_fields(tokenizer_gguf):
        w.add_key_value(name, value, vtype, sub_type=sub)
    tmap = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], cfg.num_hidden_layers)
    tensors = {}
    if rs.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_factors(cfg)
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = _permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = _permute(a, kv)
        tensors[tmap.get_name(name, try_suffixes=(".weight", ".bias"))] = a
    tensors.update(extra or {})
    for name, a in tensors.items():
        if quantized and name in quantized:
            raw, qtype = quantized[name]
            w.add_tensor(name, np.ascontiguousarray(raw, dtype=np.uint8), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build_family(root: Path, family: str, gguf_path: str, hf_tok) -> tuple[object, Path, Path]:
    """(HF model fp32, HF folder, GGUF file) of a tiny random model of `family`."""
    cfg = _hf_config(family, len(hf_tok))
    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3, "mistral": 4}[family])
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # a scale that gives varied greedy text; biases and q/k norms random so they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    folder = root / family
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    gen = {"eos_token_id": [2, 0], "bos_token_id": 1} if family == "llama" else {"eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    path = root / f"{family}.gguf"
    write_gguf(path, family, model, gguf_path)
    return model, folder, path


@pytest.fixture(scope="module", autouse=True)
def gguf_parses() -> dict:
    """Each GGUF file of this module parsed once. Every one carries SmolLM2's 49k-token vocabulary, whose metadata
    parse (engine.loading.gguf_file.open_gguf) is 1-2 CPU-s, and the tests load each file several times (greedy, config,
    quantized paths). A parse of an unchanged file is the same each time and the loaders only read it, so the
    engine's open_gguf returns the first parse of a (path, size, mtime) again: what is loaded from it is unchanged.
    Returns the parses, by that key."""
    from gguf_models import parsing_each_gguf_once

    with parsing_each_gguf_once() as parsed:
        yield parsed


@pytest.fixture(scope="module")
def hf_tok(gguf_path: str):
    from engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path).hf_tokenizer


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory, gguf_path: str, hf_tok) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_family(root, f, gguf_path, hf_tok) for f in FAMILIES}


@pytest.fixture(scope="module")
def prompt_ids(hf_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    texts = gsm8k_questions[:NUM_PROMPTS // 2] + alpaca_instructions[:NUM_PROMPTS // 2]
    return [hf_tok.encode(hf_tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False) for t in texts]


def _hf_argmax(model, prompt_ids: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """HF's greedy choice at each position of `outputs` given its prompt and the output tokens before it (one
    forward per prompt). Equals `outputs` exactly when HF's greedy generation of MAX_TOKENS (no EOS stop) does."""
    out = []
    with torch.no_grad():
        for ids, seq in zip(prompt_ids, outputs, strict=True):
            out.append(model(torch.tensor([ids + seq])).logits[0, len(ids) - 1:-1].argmax(-1).tolist())
    return out


def _hf_greedy(model, prompt_ids: list[list[int]]) -> list[list[int]]:
    gen = transformers.GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = model.generate(torch.tensor([ids]), generation_config=gen)[0, len(ids):].tolist()
            out.append(seq)
    return out


FP32 = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=16,
                    max_num_batched_tokens=512)


def _ours(model: str, prompt_ids: list[list[int]], config: EngineConfig = FP32) -> list[list[int]]:
    engine = LLMEngine.from_model(model, config)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_from_folder_and_gguf(family: str, families, prompt_ids) -> None:
    model, folder, path = families[family]
    ours = _ours(str(folder), prompt_ids)
    assert all(len(r) == MAX_TOKENS for r in ours)
    assert all(len(set(r)) >= 4 for r in ours), "degenerate random model: raise the init scale"
    assert len({t for r in ours for t in r}) > 60
    assert _hf_argmax(model, prompt_ids, ours) == ours
    assert _hf_greedy(model, prompt_ids[:1]) == ours[:1]
    assert _ours(str(path), prompt_ids) == ours


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_close_to_hf(family: str, families, prompt_ids) -> None:
    from engine.loading.loader import load_gguf_model, load_hf_model
    from engine.model.sequence_forward import forward_sequence

    model, folder, path = families[family]
    ids = torch.tensor(prompt_ids[0])
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
        for cfg, ours in (load_hf_model(str(folder), torch.float32, torch.device("cpu")),
                          load_gguf_model(str(path), torch.float32, torch.device("cpu"))):
            assert cfg.architecture in (family, "llama")
            logits = ours.compute_logits(forward_sequence(ours, ids))
            torch.testing.assert_close(logits, ref, rtol=1e-4, atol=2e-4)


def test_config_fields(families) -> None:
    """Each family's special fields reach ModelConfig, from both formats; generation_config's EOS list too. The GGUFs
    are read as the engine reads them (engine.loading.gguf_file.open_gguf: gguf.GGUFReader's fields, parsed about 3x
    faster;
    test_weights_cache.py checks that the fields are the same)."""
    from engine.loading.gguf_file import open_gguf, read_gguf_config
    from engine.loading.hf_folder import read_hf_config

    hf = {f: read_hf_config(str(families[f][1])) for f in FAMILIES}
    gg = {f: read_gguf_config(open_gguf(str(families[f][2]))) for f in FAMILIES}
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
    from engine.loading.quantized import load_model, quantize_to_folder
    from engine.model.sequence_forward import forward_sequence
    from engine.quant.int8_linear import int8_available

    _, folder, path = families[family]
    ids = torch.tensor(prompt_ids[1])
    cpu = torch.device("cpu")

    def logits(model: str, quantization: str) -> torch.Tensor:
        loaded = load_model(model, torch.float32, cpu, quantization=quantization, group_size=32)
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
        assert close(logits(str(folder), "int8"), ref) > 0.75
        from safetensors.torch import load_file

        from engine.quant.state import AddBias

        qkv = load_model(str(folder), torch.float32, cpu, quantization="int8").model.layers[0].self_attn.qkv_proj
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

def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    return out


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_extra_tensor_is_an_error(families, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from engine.loading.hf_folder import check_hf_folder

    bad = _copy(families["qwen2"][1], tmp_path)
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

    bad = _copy(families["llama"][1], tmp_path)
    _edit_config(bad, rope_parameters=None, **change)
    with pytest.raises(ValueError, match=match):
        check_hf_folder(str(bad))


def test_qwen_per_layer_window_is_an_error(families, tmp_path: Path) -> None:
    from engine.loading.hf_folder import read_hf_config

    folder = _copy(families["qwen2"][1], tmp_path)
    _edit_config(folder, use_sliding_window=True, sliding_window=16, max_window_layers=1, layer_types=None)
    with pytest.raises(ValueError, match="sliding window on some layers only"):
        read_hf_config(str(folder))
    _edit_config(folder, max_window_layers=0)
    assert read_hf_config(str(folder)).sliding_window == 16


def test_nan_weights_are_an_error(families, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    bad = _copy(families["qwen3"][1], tmp_path)
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
    assert _ours(str(out), prompt_ids[:4]) == _ours(str(folder), prompt_ids[:4])


def test_cli_refuses_bad_folder_before_work(families, gsm8k_questions, tmp_path: Path) -> None:
    """`tokenmill run --model DIR` with an unknown architecture exits 2 naming it, and writes nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = _copy(families["llama"][1], tmp_path)
    _edit_config(bad, model_type="falcon")
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"question": gsm8k_questions[:2]}), data)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(data), str(out), "--prompt-column",
                           "question", "--model", str(bad)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "'falcon' is not supported" in proc.stderr + proc.stdout
    assert not out.exists() or not any(out.iterdir())


def test_max_model_len_is_checked_against_an_hf_folder_context(families) -> None:
    """`--max-model-len` is bounded by a Hugging Face folder's own context (config.json), before any work."""
    from jobs.errors import JobError
    from jobs.preflight import check_max_model_len, model_context

    model, folder, _ = families["qwen3"]
    shape = model_context(str(folder))
    assert shape == {"context": model.config.max_position_embeddings, "layers": model.config.num_hidden_layers,
                     "kv_heads": model.config.num_key_value_heads, "head_dim": model.config.head_dim}
    check_max_model_len(str(folder), "cpu", "float32", shape["context"], 1.0)
    with pytest.raises(JobError, match=f"more than the context of qwen3, {shape['context']} tokens"):
        check_max_model_len(str(folder), "cpu", "float32", shape["context"] + 1, 1.0)
