"""gpt-oss GGUF files, as llama.cpp's convert_hf_to_gguf.py writes them, run exactly as HF transformers runs the
model they were converted from (issue 43), with MXFP4 experts and with F32 ones; what tokenmill does not implement
of such a file is an error naming it before any tensor is read.

A tiny random-weight model built by transformers from GptOssConfig (tests/engine/gpt_oss_models.py: fp32, eager
attention, a sliding window of 16 tokens on the first layer, YaRN with truncate false, 8 experts of which 2 per
token), with the SwiGLU clamp at 7.0, the limit llama.cpp fixes for every gpt-oss GGUF, and expert weights large
enough that the clamp bites. Its HF folder and an MXFP4 copy (OpenAI's layout) are written as GGUF the converter's
way, with a harmony-format chat template; the prompts are real GSM8K / AlpacaEval questions rendered by that template
through tokenmill's GGUF tokenizer. Greedy tokens equal HF's (teacher-forced argmax at every position and HF's own
`generate` on the first prompt): the F32 file's those of the HF model, the MXFP4 file's those of transformers' model
of the MXFP4 folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from family_models import hf_argmax, hf_generate
from gpt_oss_models import WINDOW, build_gpt_oss, write_gpt_oss_gguf, write_mxfp4_folder
from llama_family_models import MAX_TOKENS, our_greedy

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

NUM_PROMPTS = 4
LIMIT = 7.0  # llama.cpp's swiglu_oai limit: gpt-oss GGUFs do not store it
#: A harmony-format chat template (gpt-oss's turn markup: <|start|>role<|message|>...<|end|>), standing in for the
#: real one, which this machine cannot download; rendered from the GGUF's tokenizer.chat_template.
HARMONY = (
    "{%- if messages[0].role not in ['system', 'developer'] -%}"
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
    "2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for "
    "every message.<|end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role not in ['system', 'developer', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown role ' + message.role) }}{%- endif -%}"
    "<|start|>{{ message.role }}{% if message.role == 'assistant' %}<|channel|>final{% endif %}<|message|>"
    "{{ message.content | trim }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory, hf_tok, tok_fields) -> dict[str, object]:
    """The HF model and its GGUF files: model (fp32), mx_model (transformers' model of the MXFP4 folder), folder,
    mx_folder, f32 (GGUF, F32 experts), mxfp4 (GGUF, MXFP4 experts)."""
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    model = build_gpt_oss(len(hf_tok), LIMIT, seed=44, gate_up_scale=3.0)
    folder, mx_folder = root / "gpt_oss", root / "gpt_oss_mxfp4"
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    write_mxfp4_folder(folder, mx_folder)
    write_gpt_oss_gguf(root / "f32.gguf", folder, tok_fields, chat_template=HARMONY)
    write_gpt_oss_gguf(root / "mxfp4.gguf", mx_folder, tok_fields, chat_template=HARMONY)
    mx_model = transformers.AutoModelForCausalLM.from_pretrained(
        mx_folder, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    return dict(model=model, mx_model=mx_model, folder=folder, mx_folder=mx_folder, f32=root / "f32.gguf",
                mxfp4=root / "mxfp4.gguf")


@pytest.fixture(scope="module")
def questions(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    return gsm8k_questions[:NUM_PROMPTS // 2] + alpaca_instructions[:NUM_PROMPTS // 2]


@pytest.fixture(scope="module")
def prompt_ids(gpt_oss, questions: list[str]) -> list[list[int]]:
    """The questions as chat prompts, through tokenmill's tokenizer of the MXFP4 GGUF (its harmony template)."""
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(str(gpt_oss["mxfp4"]))
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


@pytest.fixture(scope="module")
def ours(gpt_oss, prompt_ids) -> dict[str, list[list[int]]]:
    """Our greedy tokens from each GGUF file (fp32, CPU)."""
    return {kind: our_greedy(str(gpt_oss[kind]), prompt_ids) for kind in ("f32", "mxfp4")}


def test_chat_template_comes_from_the_gguf(prompt_ids, questions, hf_tok) -> None:
    """The prompts are the GGUF's harmony template rendered (jinja2, as transformers does) and encoded as text, and
    every one is longer than twice the window."""
    import jinja2

    template = jinja2.Environment().from_string(HARMONY)
    for ids, q in zip(prompt_ids, questions, strict=True):
        text = template.render(messages=[{"role": "user", "content": q}], add_generation_prompt=True)
        assert text.startswith("<|start|>system<|message|>") and text.endswith("<|end|><|start|>assistant")
        assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert min(len(p) for p in prompt_ids) > 2 * WINDOW


def test_f32_experts_gguf_matches_hf(gpt_oss, prompt_ids, ours) -> None:
    """The GGUF with F32 experts gives HF's greedy tokens, and the SwiGLU clamp at 7.0 changes them (so the limit
    the GGUF implies is the one applied)."""
    model, got = gpt_oss["model"], ours["f32"]
    assert all(len(r) == MAX_TOKENS for r in got)
    assert all(len(set(r)) >= 4 for r in got), "degenerate random model: change the init"
    assert hf_argmax(model, prompt_ids, got) == got
    assert hf_generate(model, prompt_ids[:1], MAX_TOKENS) == got[:1]
    experts = [layer.mlp.experts for layer in model.model.layers]
    try:
        for e in experts:
            e.limit = float("inf")
        assert hf_argmax(model, prompt_ids[:1], got[:1]) != got[:1]
    finally:
        for e in experts:
            e.limit = LIMIT


def test_mxfp4_gguf_matches_hf(gpt_oss, prompt_ids, ours) -> None:
    """The GGUF with MXFP4 experts gives the greedy tokens of transformers' model of the MXFP4 folder it was converted
    from, not the dense model's (the blocks are read)."""
    assert hf_argmax(gpt_oss["mx_model"], prompt_ids, ours["mxfp4"]) == ours["mxfp4"]
    assert ours["mxfp4"] != ours["f32"]


def test_mxfp4_dequantizes_bit_equal_to_gguf_py(gpt_oss, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MXFP4 tensor of the file dequantizes bit for bit as gguf-py's `gguf.quants.dequantize` (in row chunks
    across the stacked experts too), to the values transformers dequantizes from the HF blocks (the converter's
    repack and split, undone); and every scale byte with every code, subnormal, inf and +0 included."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.loading import gguf_file
    from engine.loading.gpt_oss_tensors import dequantize_gguf_mxfp4

    monkeypatch.setattr(gguf_file, "_DEQUANT_CHUNK", 3 * 64)  # 3 rows a chunk: 171 chunks over 8 experts x 64 rows
    hf = load_file(gpt_oss["mx_folder"] / "model.safetensors")
    tensors = [t for t in gguf_file.open_gguf(str(gpt_oss["mxfp4"])).tensors if t.tensor_type.name == "MXFP4"]
    assert len(tensors) == 6
    for t in tensors:
        got = gguf_file.dequantize_tensor(t)
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert got.shape == want.shape == (8, 64, 64)
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
        layer, proj = t.name.split(".")[1], t.name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
        key = f"model.layers.{layer}.mlp.experts.{'down' if proj == 'down' else 'gate_up'}_proj"
        hf_w = convert_moe_packed_tensors(hf[f"{key}_blocks"], hf[f"{key}_scales"], dtype=torch.float32)
        hf_w = hf_w.transpose(1, 2)  # [E, out, in]; gate and up rows interleaved
        hf_w = hf_w if proj == "down" else hf_w[:, 0::2] if proj == "gate" else hf_w[:, 1::2]
        assert torch.equal(torch.from_numpy(got), hf_w)
    every = np.zeros((256, 17), dtype=np.uint8)
    every[:, 0] = np.arange(256)
    every[:, 1:] = np.arange(16, dtype=np.uint8) * 17  # codes 0..15 in both nibbles
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(every, gguf.GGMLQuantizationType.MXFP4)
    got = dequantize_gguf_mxfp4(every)
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    assert np.isinf(got).any() and (got[0][got[0] != 0] < 2.0 ** -120).all() and not np.signbit(got[:, 8]).any()
    with pytest.raises(ValueError, match="MXFP4 data is uint8"):
        dequantize_gguf_mxfp4(every[:, :16])


def test_gguf_config_equals_the_hf_folder(gpt_oss, hf_tok) -> None:
    """The GGUF's config is the HF folder's: sliding layers and window, YaRN (truncate false), experts, sinks, biases,
    the clamped SwiGLU; eps as float32 (GGUF stores it so); the stop tokens add <|endoftext|> (by text, as
    gpt-oss's generation_config does). The CLI's header-only reader gives the same config and tensor names."""
    from dataclasses import replace

    from engine.loading.gguf_config import gguf_name_map, read_gguf_config
    from engine.loading.gguf_file import open_gguf
    from engine.loading.gguf_header import GGUFHeader
    from engine.loading.hf_folder import read_hf_config

    want = read_hf_config(str(gpt_oss["folder"]))
    for kind in ("f32", "mxfp4"):
        reader, header = open_gguf(str(gpt_oss[kind])), GGUFHeader(str(gpt_oss[kind]))
        got = read_gguf_config(reader)
        assert read_gguf_config(header) == got and gguf_name_map(header, got) == gguf_name_map(reader, got)
        assert got.eos_token_ids == (*want.eos_token_ids, hf_tok.convert_tokens_to_ids("<|endoftext|>"))
        assert got.rms_norm_eps == float(np.float32(want.rms_norm_eps))
        assert replace(got, eos_token_ids=want.eos_token_ids, rms_norm_eps=want.rms_norm_eps) == want
        assert got.layer_types == ("sliding_attention", "full_attention") and got.sliding_window == WINDOW
        assert got.rope_scaling.rope_type == "yarn" and got.rope_scaling.truncate is False
        assert (got.swiglu_limit, got.swiglu_alpha, got.attention_sinks, got.expert_bias) == (LIMIT, 1.702, True, True)
        assert gguf_name_map(reader, got)["blk.1.attn_sinks.weight"] == "layers.1.self_attn.sinks"


REFUSED = {  # what the file sets -> the words of the error
    "gating": (dict(metadata={"expert_gating_func": 2}), "expert_gating_func=2"),
    "weights_scale": (dict(metadata={"expert_weights_scale": 2.5}), "expert_weights_scale=2.5"),
    "swa_base": (dict(metadata={"rope.freq_base_swa": 10000.0}), "freq_base_swa=10000.0"),
    "pattern_array": (dict(metadata={"attention.sliding_window_pattern": [True, False]}), "sliding_window_pattern"),
    "no_window": (dict(metadata={"attention.sliding_window": 0}), "lacks gpt-oss.attention.sliding_window"),
    "yarn_log_mul": (dict(metadata={"rope.scaling.yarn_log_multiplier": 0.1}), "yarn_log_multiplier=0.1"),
    "fused_gate_up": (dict(tensors={"blk.0.ffn_gate_up_exps.weight": np.zeros((8, 128, 64), np.float32)},
                           drop=("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight")),
                      "'blk.0.ffn_gate_up_exps.weight' is not part of the gpt_oss architecture"),
}


def _variant(path: Path, folder: Path, metadata: dict | None = None, **changes: object) -> Path:
    """The F32 file with `metadata` and `changes` (write_gpt_oss_gguf's), its vocabulary size in place of the
    tokenizer (the config needs no more: faster)."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    write_gpt_oss_gguf(path, folder, [], metadata={"vocab_size": vocab, **(metadata or {})}, **changes)
    return path


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_is_not_implemented_is_refused_before_reading(case: str, gpt_oss, tmp_path: Path) -> None:
    """A key or tensor the converter (or llama.cpp) can write whose math tokenmill does not run is a ValueError
    naming it, from the metadata and tensor names alone: where the engine loads the file and in the CLI's check of
    its header (jobs.plan.preflight: exit 2 before the job)."""
    from engine.loading.gguf_config import gguf_name_map, read_gguf_config
    from engine.loading.gguf_file import open_gguf
    from engine.loading.gguf_header import GGUFHeader

    variant, words = REFUSED[case]
    path = str(_variant(tmp_path / f"{case}.gguf", gpt_oss["folder"], **variant))
    for reader in (open_gguf(path), GGUFHeader(path)):
        with pytest.raises(ValueError, match=words.replace(".", r"\.").replace("[", r"\[")):
            gguf_name_map(reader, read_gguf_config(reader))


def test_the_cli_refuses_such_a_file_before_the_job(gpt_oss, gsm8k_questions: list[str], tmp_path: Path) -> None:
    """`tokenmill run --model FILE.gguf` with a key tokenmill does not run exits 2 naming it and writes nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from jobs.cli import app

    path = _variant(tmp_path / "scaled.gguf", gpt_oss["folder"], {"expert_weights_scale": 2.5})
    pq.write_table(pa.table({"question": gsm8k_questions[:2]}), tmp_path / "in.parquet")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", str(tmp_path / "in.parquet"), str(out), "--prompt-column", "question",
                                   "--model", str(path)])
    assert res.exit_code == 2, res.output
    assert "gpt-oss.expert_weights_scale=2.5 is not implemented" in res.stderr and not out.exists()


@pytest.mark.parametrize(("period", "types"), [(1, ("full_attention",) * 2), (3, ("sliding_attention",) * 2)])
def test_sliding_window_pattern_is_read_as_llama_cpp_does(period: int, types, gpt_oss, tmp_path: Path) -> None:
    """`attention.sliding_window_pattern` p: layer i slides when i % p < p - 1 (llama.cpp's set_swa_pattern)."""
    from engine.loading.gguf_file import open_gguf, read_gguf_config

    path = _variant(tmp_path / "pattern.gguf", gpt_oss["folder"], {"attention.sliding_window_pattern": period})
    cfg = read_gguf_config(open_gguf(str(path)))
    assert cfg.layer_types == types and cfg.sliding_window == (WINDOW if "sliding_attention" in types else None)
