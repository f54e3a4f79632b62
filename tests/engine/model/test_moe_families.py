"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral; engine.layers.moe) run exactly as HF transformers
does, from a Hugging Face folder and from GGUF, and what tokenmill does not implement of them is an error before any
work (issue 43). Their INT4 and INT8 experts: test_moe_quantized.py.

Per family: a tiny random-weight model built by HF transformers from the family's config class, saved as an HF folder
and written as GGUF as llama.cpp's converter writes it (tests/engine/moe_models.py). Greedy tokens on real prompts
equal HF's (teacher-forced argmax at every position, and HF's own `generate` on the first prompt; test_families.py
says why that is HF's greedy output).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_models import chat_prompt_ids
from llama_family_models import FP32, MAX_TOKENS, hf_argmax, hf_greedy, our_greedy
from moe_models import FAMILIES, build_moe_families, write_moe_gguf

from engine import LLMEngine

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

NUM_PROMPTS = 8
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router", "norm_topk_prob",
              "shared_expert_intermediate_size")


@pytest.fixture(scope="module")
def moe_families(tmp_path_factory: pytest.TempPathFactory, gguf_path: str, hf_tok) -> dict[str, tuple]:
    """{family: (HF model fp32, HF folder, GGUF file)}."""
    return build_moe_families(tmp_path_factory.mktemp("moe"), gguf_path, hf_tok)


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
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence

    for family in FAMILIES:
        model = open_model(str(moe_families[family][1]), torch.float32, torch.device("cpu"), tokenizer=False).model
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
    from engine.loading.open_model import open_model
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
                     for m in (open_model(str(p), torch.float32, torch.device("cpu"), tokenizer=False).model
                               for p in (path, q8)))
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
    from jobs.cli.doctor import model_report

    report = model_report(str(moe_families["qwen3_moe"][1]))
    assert (report["family"], report["experts"], report["experts_active"]) == ("qwen3_moe", 8, 2)
    assert model_report(str(moe_families["mixtral"][2]))["summary"] == (
        "mixtral, 2 layers, hidden 64, 8 experts (2 active per token)")


def test_auto_runs_plain_experts_as_stored(moe_families, prompt_ids) -> None:
    """quantization "auto" runs F32 experts as stored: the same logits as "none" (INT4 and INT8 experts:
    test_moe_quantized.py)."""
    from engine.loading.open_model import open_model
    from engine.model.sequence_forward import forward_sequence

    _, _, path = moe_families["qwen2_moe"]
    cpu = torch.device("cpu")
    ids = torch.tensor(prompt_ids[2])
    with torch.no_grad():
        none, auto = (m.model.compute_logits(forward_sequence(m.model, ids))
                      for m in (open_model(str(path), torch.float32, cpu, quantization=q, tokenizer=False)
                                for q in ("none", "auto")))
    torch.testing.assert_close(auto, none)
