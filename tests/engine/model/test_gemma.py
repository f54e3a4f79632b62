"""Gemma 2 and Gemma 3 text run exactly as HF transformers does, from a Hugging Face folder and from GGUF (issue 43).

Each family is a tiny random model built by transformers from its own config class (tests/engine/family_models.py):
sliding windows of 24 tokens on the sliding layers (every chat-templated prompt is longer, so they matter), Gemma 2's
attention and final soft-caps low enough that the tiny scores reach them, Gemma 3's local and global RoPE bases
(the global one linearly scaled) and its q/k norms; norms of (1 + weight), the embedding scale, GeGLU and the
sandwich norms come with the families. Greedy generation in fp32 on 16 real prompts x 32 tokens is token-identical
to HF (eager attention) from both formats and on both CPU attention backends: HF's argmax at every output position
given the prompt and our earlier tokens is our token (test_hf_parity.py argues why that is HF's greedy output), and
HF's own `generate` gives the same tokens on the first prompt.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports the Triton kernels: they run interpreted on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

FAMILIES = ("gemma2", "gemma3_text")
MAX_TOKENS = 32
FP32 = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=16,
                    max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory: pytest.TempPathFactory, family_tok, tok_fields) -> dict[str, tuple]:
    """{family: (HF model fp32, HF folder, GGUF file)}."""
    from family_models import build_hf, save_folder, write_gguf

    root = tmp_path_factory.mktemp("gemma")
    out = {}
    for family in FAMILIES:
        model = build_hf(family, len(family_tok))
        folder = save_folder(model, root / family, family_tok)
        write_gguf(root / f"{family}.gguf", family, model, tok_fields)
        out[family] = (model, folder, root / f"{family}.gguf")
    return out


def _ours(model: str | LLMEngine, prompt_ids: list[list[int]], config: EngineConfig = FP32) -> list[list[int]]:
    """Greedy MAX_TOKENS tokens per prompt of a model path (loaded with `config`) or of a loaded engine."""
    engine = model if isinstance(model, LLMEngine) else LLMEngine.from_model(model, config)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_from_folder_and_gguf(family: str, gemmas, family_prompts) -> None:
    from family_models import hf_argmax, hf_generate

    model, folder, path = gemmas[family]
    assert min(len(p) for p in family_prompts) > model.config.sliding_window  # every prompt crosses the window
    engine = LLMEngine.from_model(str(folder), FP32)
    ours = _ours(engine, family_prompts)
    assert all(len(r) == MAX_TOKENS for r in ours)
    assert all(len(set(r)) >= 3 for r in ours), "degenerate random model: change the init"
    assert len({t for r in ours for t in r}) > 60
    assert hf_argmax(model, family_prompts, ours) == ours
    assert hf_generate(model, family_prompts[:1], MAX_TOKENS) == ours[:1]
    assert _ours(str(path), family_prompts) == ours
    # the torch reference attention on the same weights (with_config shares the loaded model)
    torch_backend = engine.with_config(EngineConfig(**{**FP32.__dict__, "attention_backend": "torch"}))
    assert torch_backend.runner.attn_fn.__name__ == "paged_attention_ref"
    assert _ours(torch_backend, family_prompts[:4]) == ours[:4]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_close_to_hf(family: str, gemmas, family_prompts) -> None:
    """Full-sequence logits (soft-capped) of both formats against HF's: a missing cap, norm offset or RoPE base
    would be far off."""
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence

    model, folder, path = gemmas[family]
    ids = torch.tensor(family_prompts[0])
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
        for cfg, ours, *_ in (open_model(str(folder), torch.float32, torch.device("cpu"), tokenizer=False),
                              open_model(str(path), torch.float32, torch.device("cpu"), tokenizer=False)):
            assert cfg.architecture == family
            torch.testing.assert_close(ours.compute_logits(forward_sequence(ours, ids)), ref, rtol=1e-4, atol=2e-4)


def test_config_fields(gemmas) -> None:
    """The Gemma fields reach ModelConfig from config.json and from GGUF metadata alike."""
    from engine.loading.gguf_file import open_gguf, read_gguf_config
    from engine.loading.hf_folder import read_hf_config

    for family in FAMILIES:
        hf = read_hf_config(str(gemmas[family][1]))
        gg = read_gguf_config(open_gguf(str(gemmas[family][2])))
        for cfg in (hf, gg):
            assert cfg.architecture == family and cfg.tie_word_embeddings
            assert cfg.norm_weight_offset == 1.0 and cfg.sandwich_norms and cfg.hidden_act == "gelu_pytorch_tanh"
            assert cfg.embedding_scale == pytest.approx(8.0) and cfg.query_pre_attn_scalar == 16
            assert cfg.sliding_window == 24 and cfg.final_logit_softcapping == 5.0
        assert hf.layer_types == gg.layer_types == tuple(gemmas[family][0].config.layer_types)
        assert hf.rope_scaling == gg.rope_scaling
    g2 = read_hf_config(str(gemmas["gemma2"][1]))
    assert g2.layer_types == ("sliding_attention", "full_attention") and g2.attn_logit_softcapping == 2.0
    g3 = read_hf_config(str(gemmas["gemma3_text"][1]))
    assert g3.layer_types.count("full_attention") == 1 and g3.qk_norm and g3.attn_logit_softcapping is None
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling.rope_type) == (1e6, 1e4, "linear")


def test_gemma3_old_config_layout(gemmas, tmp_path: Path) -> None:
    """A Gemma 3 config.json as transformers 4 wrote it (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern, no layer_types) reads to the same config as transformers 5's layout."""
    from engine.loading.hf_folder import read_hf_config

    folder = tmp_path / "old"
    shutil.copytree(gemmas["gemma3_text"][1], folder)
    cfg = json.loads((folder / "config.json").read_text())
    new = read_hf_config(str(folder))
    for key in ("rope_parameters", "layer_types"):
        cfg.pop(key)
    cfg.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    (folder / "config.json").write_text(json.dumps(cfg))
    assert read_hf_config(str(folder)) == new


def test_softcapped_paged_attention_matches_dense_oracle() -> None:
    """Soft-capping in the torch reference and the C++ kernel (decode rows, short and long prefill chunks, with and
    without a window, GQA) against the dense float64 oracle; without the cap the outputs differ."""
    from attention_steps import dense_attention, make_step

    import engine.layers.attention as attention

    cap, scale = 1.5, 0.5
    q, kc, vc, meta = make_step([1, 1, 7, 40], [9, 33, 20, 70], 4, 2, 16, torch.float32, head_dim=32)
    for window in (None, 12):
        want = dense_attention(q, kc, vc, meta, scale, window, softcap=cap)
        plain = dense_attention(q, kc, vc, meta, scale, window)
        assert (want - plain).abs().max() > 0.1
        for fn in (attention.paged_attention_ref, attention.paged_attention_cpu):
            got = fn(q, kc, vc, meta, scale, sliding_window=window, softcap=cap)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a step whose prefill chunk exceeds the C++ kernel's pairs: decodes in C++, the chunk through the eager path
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "CPU_KERNEL_MAX_PREFILL_PAIRS", 0)
        got = attention.paged_attention_cpu(q, kc, vc, meta, scale, sliding_window=12, softcap=cap)
    torch.testing.assert_close(got, dense_attention(q, kc, vc, meta, scale, 12, softcap=cap), rtol=1e-4, atol=1e-4)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="softcap"):
            attention.paged_attention_ref(q, kc, vc, meta, scale, softcap=bad)


def test_gemma2_on_the_triton_backend_matches_hf(gemmas, family_prompts) -> None:
    """Gemma 2 (soft-capped attention on every layer, sliding windows on every other one) through the whole engine on
    the Triton kernels: chunked prefill (chunks of 40 tokens, longer than the 24-token window) and decode, greedy
    tokens equal to HF's. Without CUDA the kernels run in Triton's interpreter (set at this module's import), so
    fewer prompts and tokens than the parity test above."""
    pytest.importorskip("triton")
    from family_models import hf_argmax
    from triton_testing import skip_without_a_backend

    from engine.layers.triton_attention import paged_attention_triton

    skip_without_a_backend("engine.kernels.triton_attention_kernels", "paged_decode_kernel")
    cfg = EngineConfig(device="cpu" if INTERPRET else "cuda", dtype="float32", num_kv_blocks=128, block_size=8,
                       max_num_batched_tokens=40, attention_backend="triton", enforce_eager=True)
    engine = LLMEngine.from_model(str(gemmas["gemma2"][1]), cfg)
    assert engine.runner.attn_fn is paged_attention_triton
    prompts = family_prompts[:3]
    assert min(len(p) for p in prompts) > 40
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    ours = [o.output_token_ids for o in outs]
    assert hf_argmax(gemmas["gemma2"][0], prompts, ours) == ours


@pytest.mark.parametrize(("family", "change", "match"), [
    ("gemma2", {"hidden_activation": "gelu"}, r"hidden_activation='gelu'"),
    ("gemma2", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, r"rope_scaling type 'linear'"),
    ("gemma2", {"attention_bias": True}, r"attention_bias=True"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50\.0"),
    ("gemma3_text", {"use_bidirectional_attention": True}, r"use_bidirectional_attention"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                         "full_attention": {"rope_type": "default"}}}, r"sliding layers' RoPE"),
    ("gemma3_text", {"layer_types": ["sliding_attention"]}, r"layer_types"),
])
def test_unsupported_gemma_config_is_an_error(family: str, change: dict, match: str, gemmas, tmp_path: Path) -> None:
    from engine.loading.hf_folder import check_hf_folder

    bad = tmp_path / "bad"
    shutil.copytree(gemmas[family][1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        check_hf_folder(str(bad))


def test_gptq_refuses_and_int8_runs_a_gemma_block(gemmas, family_prompts) -> None:
    """GPTQ's staged forward is Llama's block: a Gemma model is refused, naming RTN. INT8 (SmoothQuant divides
    the (1 + weight) norms the MLP and attention read) stays close to fp32."""
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence
    from engine.ptq.gptq import gptq_quantize_model
    from engine.quant.int8_linear import int8_available

    folder = str(gemmas["gemma2"][1])
    cpu = torch.device("cpu")
    model = open_model(folder, torch.float32, cpu, tokenizer=False).model
    with pytest.raises(ValueError, match="gemma2 block.*RTN"):
        gptq_quantize_model(model, torch.tensor([family_prompts[0][:16]]), group_size=32)
    if not int8_available():
        return
    ids = torch.tensor(family_prompts[1])
    with torch.no_grad():
        ref = model.compute_logits(forward_sequence(model, ids))
        q8 = open_model(folder, torch.float32, cpu, quantization="int8").model
        q8.fuse_projections()
        got = q8.compute_logits(forward_sequence(q8, ids))
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.9
