"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral; engine.layers.moe) run exactly as HF transformers
does, from a Hugging Face folder and from GGUF, and what tokenmill does not implement of them is an error before any
work (issue 43).

Per family: a tiny random-weight model built by HF transformers from the family's config class (2 layers, hidden 64,
8 experts, top-2; Qwen3-MoE with norm_topk_prob and q/k norms, Qwen2-MoE with its gated shared expert and QKV bias,
Mixtral with a sliding window shorter than the prompts), saved with save_pretrained (per-expert tensors, as real
checkpoints hold them) beside the real SmolLM2 tokenizer, and written as GGUF in the layout llama.cpp's
convert_hf_to_gguf.py writes (experts stacked into blk.N.ffn_{gate,up,down}_exps, the router as ffn_gate_inp,
Mixtral as "llama" with permuted Q/K). Greedy tokens on real prompts equal HF's (teacher-forced argmax at every
position, and HF's own `generate` on the first prompt; test_families.py says why that is HF's greedy output).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from family_models import chat_prompt_ids, finish_gguf
from llama_family_models import FP32, MAX_TOKENS, hf_argmax, hf_greedy, our_greedy, permute, randomize, tokenizer_fields

from engine import LLMEngine

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

NUM_PROMPTS = 8
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router", "norm_topk_prob",
              "shared_expert_intermediate_size")
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
             tie_word_embeddings=False)


def _hf_config(family: str, vocab: int):
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(vocab_size=vocab, num_experts=8, moe_intermediate_size=48, head_dim=32,
                                           norm_topk_prob=True, rope_theta=1e6, **SHAPE)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(vocab_size=vocab, num_experts=8, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=80, rope_theta=1e6, **SHAPE)
    if family == "mixtral":
        return transformers.MixtralConfig(vocab_size=vocab, num_local_experts=8, sliding_window=24, rope_theta=1e6,
                                          **SHAPE)
    raise AssertionError(family)


def write_moe_gguf(path: Path, family: str, folder: Path, tokenizer_gguf: str,
                   expert_type: object = None, weights_norm: bool | None = None) -> None:
    """The HF folder's model as llama.cpp's converter writes it (F32, or the stacked gate/up expert tensors in
    `expert_type`, a gguf.GGMLQuantizationType), with the tokenizer fields of `tokenizer_gguf`; `weights_norm`:
    an `{arch}.expert_weights_norm` field (the converter writes none for these families)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[family]
    heads, kv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if weights_norm is not None:
        w.add_expert_weights_norm(weights_norm)
    for name, value, vtype, sub in tokenizer_fields(tokenizer_gguf):
        w.add_key_value(name, value, vtype, sub_type=sub)
    tmap = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    tensors, per_expert = {}, {}
    for name, t in load_file(folder / "model.safetensors").items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:  # the converter stacks a layer's experts per projection
            per_expert.setdefault((int(m[1]), m[2], m[4]), {})[int(m[3])] = t.numpy()
            continue
        a = t.numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, kv)
        tensors[tmap.get_name(name, try_suffixes=(".weight", ".bias"))] = a
    for (bid, block, proj), parts in per_expert.items():
        merged = (f"layers.{bid}.feed_forward.experts.{proj}" if block == "block_sparse_moe"
                  else f"model.layers.{bid}.mlp.experts.{proj}")
        tensors[tmap.get_name(f"{merged}.weight", try_suffixes=(".weight",))] = np.stack(
            [parts[e] for e in range(experts)])
    finish_gguf(w, {name: (gguf.quants.quantize(np.ascontiguousarray(a, np.float32), expert_type), expert_type)
                       if expert_type is not None and name.endswith(("gate_exps.weight", "up_exps.weight"))
                       else (a, gguf.GGMLQuantizationType.F32) for name, a in tensors.items()})


@pytest.fixture(scope="module")
def moe_families(tmp_path_factory: pytest.TempPathFactory, gguf_path: str, hf_tok) -> dict[str, tuple]:
    """{family: (HF model fp32, HF folder, GGUF file)}."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for seed, family in enumerate(FAMILIES):
        torch.manual_seed(10 + seed)
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(family, len(hf_tok)),
                                                              dtype=torch.float32).eval()
        randomize(model)
        folder = root / family
        model.save_pretrained(folder)
        hf_tok.save_pretrained(folder)
        path = root / f"{family}.gguf"
        write_moe_gguf(path, family, folder, gguf_path)
        out[family] = (model, folder, path)
    return out


@pytest.fixture(scope="module")
def prompt_ids(hf_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    return chat_prompt_ids(hf_tok, gsm8k_questions, alpaca_instructions, NUM_PROMPTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_from_folder_and_gguf(family: str, moe_families, prompt_ids) -> None:
    model, folder, path = moe_families[family]
    ours = our_greedy(str(folder), prompt_ids)
    assert all(len(r) == MAX_TOKENS for r in ours)
    assert all(len(set(r)) >= 4 for r in ours), "degenerate random model: raise the init scale"
    assert hf_argmax(model, prompt_ids, ours) == ours
    assert hf_greedy(model, prompt_ids[:1]) == ours[:1]
    assert our_greedy(str(path), prompt_ids) == ours


def test_routing_uses_several_experts(moe_families, prompt_ids) -> None:
    """The tiny models route tokens to most experts (a test of routing that only ever picks two would not see a
    wrong router), and the engine's block runs only the experts the router picked."""
    from engine.layers.moe import GroupedExperts
    from engine.loading.loader import load_hf_model
    from engine.model.sequence_forward import forward_sequence

    for family in FAMILIES:
        _, model = load_hf_model(str(moe_families[family][1]), torch.float32, torch.device("cpu"))
        used: list[set[int]] = []

        def record(module, args, _used=used) -> None:
            _used.append(set(args[1].reshape(-1).tolist()))

        hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, GroupedExperts)]
        with torch.no_grad():
            forward_sequence(model, torch.tensor(prompt_ids[0]))
        for h in hooks:
            h.remove()
        assert len(used) == 2 and all(len(u) >= 6 for u in used), (family, used)


def test_config_fields(moe_families) -> None:
    """Each family's expert fields reach ModelConfig, from both formats, and the summary names them."""
    from engine.loading.gguf_file import open_gguf, read_gguf_config
    from engine.loading.hf_folder import read_hf_config
    from engine.model.architectures import describe

    for family in FAMILIES:
        hf = read_hf_config(str(moe_families[family][1]))
        gg = read_gguf_config(open_gguf(str(moe_families[family][2])))
        for field in MOE_FIELDS + ("architecture", "qkv_bias", "qk_norm", "head_dim", "sliding_window"):
            assert getattr(hf, field) == getattr(gg, field), (family, field)
        assert gg.architecture == family and hf.num_experts == 8 and hf.num_experts_per_tok == 2
    qwen3, qwen2, mixtral = (read_hf_config(str(moe_families[f][1])) for f in FAMILIES)
    assert (qwen3.router, qwen3.norm_topk_prob, qwen3.moe_intermediate_size, qwen3.qk_norm) == (
        "softmax_topk", True, 48, True)
    assert (qwen2.router, qwen2.norm_topk_prob, qwen2.shared_expert_intermediate_size, qwen2.qkv_bias) == (
        "softmax_topk", False, 80, True)
    assert (mixtral.router, mixtral.moe_intermediate_size, mixtral.sliding_window) == ("topk_softmax", 96, 24)
    assert describe(qwen2) == "qwen2_moe, 2 layers, hidden 64, 8 experts (2 active per token, plus a shared expert)"


def test_quantized_gguf_experts(moe_families, gguf_path: str, prompt_ids, tmp_path: Path) -> None:
    """Q8_0 gate/up expert tensors (block-quantized 3-D tensors) load dequantized and stay close to the F32 file; an
    expert_weights_norm field overrides llama.cpp's default renormalisation of the architecture."""
    from engine.loading.gguf_file import open_gguf, read_gguf_config
    from engine.loading.loader import load_gguf_model
    from engine.model.sequence_forward import forward_sequence

    _, folder, path = moe_families["qwen3_moe"]
    q8 = tmp_path / "q8.gguf"
    write_moe_gguf(q8, "qwen3_moe", folder, gguf_path, expert_type=gguf.GGMLQuantizationType.Q8_0,
                   weights_norm=False)
    assert read_gguf_config(open_gguf(str(path))).norm_topk_prob
    assert not read_gguf_config(open_gguf(str(q8))).norm_topk_prob
    write_moe_gguf(q8, "qwen3_moe", folder, gguf_path, expert_type=gguf.GGMLQuantizationType.Q8_0)
    ids = torch.tensor(prompt_ids[1])
    with torch.no_grad():
        want, got = (m.compute_logits(forward_sequence(m, ids))
                     for _, m in (load_gguf_model(str(p), torch.float32, torch.device("cpu")) for p in (path, q8)))
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item() > 0.999
    assert not torch.equal(got, want)


# ---- never silently wrong ---------------------------------------------------------------------------------------

def _edited(folder: Path, tmp_path: Path, **changes: object) -> Path:
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(("family", "change", "match"), [
    ("qwen2_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 .*dense MLP layers"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
    ("qwen2_moe", {"qkv_bias": False}, r"qkv_bias=False"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 32}, r"shared_expert_intermediate_size=32"),
    ("mixtral", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ("qwen3_moe", {"num_experts": 6}, r"experts \[0, 1, 2, 3\]\.\.\. \(8\), not 0\.\.\.5"),
])
def test_unsupported_config_is_an_error(family: str, change: dict, match: str, moe_families, tmp_path: Path) -> None:
    from engine.loading.hf_folder import check_hf_folder

    with pytest.raises(ValueError, match=match):
        check_hf_folder(str(_edited(moe_families[family][1], tmp_path, **change)))


def test_missing_expert_is_an_error(moe_families, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    bad = _edited(moe_families["mixtral"][1], tmp_path)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj\.weight has experts .*first odd one: 5"):
        LLMEngine.from_model(str(bad), FP32)


def test_doctor_names_family_and_experts(moe_families) -> None:
    from jobs.doctor import model_report

    report = model_report(str(moe_families["qwen3_moe"][1]))
    assert (report["family"], report["experts"], report["experts_active"]) == ("qwen3_moe", 8, 2)
    assert model_report(str(moe_families["mixtral"][2]))["summary"] == (
        "mixtral, 2 layers, hidden 64, 8 experts (2 active per token)")


def test_quantization_of_experts(moe_families, prompt_ids, tmp_path: Path) -> None:
    """INT4/INT8 of experts is not implemented: an error naming it, before any work; "auto" runs the experts as
    stored (F32 here), the same logits as "none"."""
    from engine.loading.quantized import load_model, quantize_to_folder
    from engine.model.sequence_forward import forward_sequence

    _, folder, path = moe_families["qwen2_moe"]
    cpu = torch.device("cpu")
    for model, mode in ((folder, "int4"), (path, "int4"), (path, "int8")):
        with pytest.raises(ValueError, match=f"{mode} quantization of a mixture-of-experts model \\(qwen2_moe, 8"):
            load_model(str(model), torch.float32, cpu, quantization=mode)
    with pytest.raises(ValueError, match="tokenmill quantize --bits 4 quantization of a mixture-of-experts"):
        quantize_to_folder(str(folder), str(tmp_path / "q4"), bits=4)
    ids = torch.tensor(prompt_ids[2])
    with torch.no_grad():
        none, auto = (m.model.compute_logits(forward_sequence(m.model, ids))
                      for m in (load_model(str(path), torch.float32, cpu, quantization=q) for q in ("none", "auto")))
    torch.testing.assert_close(auto, none)


def test_cli_refuses_int4_of_experts_before_work(moe_families, gsm8k_questions, tmp_path: Path) -> None:
    """`tokenmill run --quantization int4` of a MoE folder or GGUF exits 2 naming it, and writes nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from jobs.cli import app

    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"question": gsm8k_questions[:2]}), data)
    for model in moe_families["qwen3_moe"][1:]:
        out = tmp_path / f"out-{model.name}"
        result = CliRunner().invoke(app, ["run", str(data), str(out), "--prompt-column", "question", "--model",
                                          str(model), "--quantization", "int4"], env={"COLUMNS": "200"})
        assert result.exit_code == 2, result.output
        assert "mixture-of-experts model (qwen3" in " ".join(result.output.split())
        assert not out.exists() or not any(out.iterdir())
