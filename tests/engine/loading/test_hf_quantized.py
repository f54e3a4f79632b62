"""Quantized Hugging Face folders (issue 42): GPTQ, AWQ GEMM and compressed-tensors checkpoints load with weights
equal bit for bit to the format's reference dequantization, their 4-bit layers kept as stored INT4 where exact, and
run greedy token-identical to HF transformers (on the folder itself where transformers runs it on the CPU:
compressed-tensors; else on the exactly dequantized fp32 model) on 16 real prompts x 32 tokens; unknown methods and
GPTQ tensors without a quantization_config are refused before any work.

The folders are tiny random Llama / Qwen2 models (tests/engine/loading/quant_writers.py packs them as the producers
do; compressed-tensors through its own pack_to_int32).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
import quant_writers as qw  # noqa: E402

NUM_PROMPTS, MAX_TOKENS = 16, 32
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def _act_order(k: int, group: int) -> torch.Tensor:
    """GPTQ act-order's g_idx: features taken in a (seeded random) order, each run of `group` one group."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(7))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group
    return g_idx


def _gptq(bits: int, group: int, sym: bool, v1: bool, act_order: bool = False):
    def layer(w):
        g_idx = _act_order(w.shape[1], group) if act_order else None
        q, z, s, g = qw.rtn(w, bits, group, sym, g_idx=g_idx)
        return qw.gptq_tensors(q, z, s, g, bits, v1), qw.dequant(q, z, s, g)
    config = {"bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return "gptq", config, layer


def _awq(group: int):
    def layer(w):
        q, z, s, g = qw.rtn(w, 4, group, sym=False)
        return qw.awq_tensors(q, z, s), qw.dequant(q, z, s, g)
    return "awq", {"bits": 4, "group_size": group, "version": "gemm", "zero_point": True}, layer


def _ct_int(bits: int, strategy: str, sym: bool, packed: bool, activations: dict | None = None):
    group = 32 if strategy == "group" else -1

    def layer(w):  # fp32 scales holding bf16 values: exact in INT4, and HF dequantizes them in fp32
        q, z, s, g = qw.rtn(w, bits, group, sym, scale_dtype=torch.bfloat16)
        return qw.ct_int_tensors(q, z, s.float(), bits, packed, sym), qw.dequant(q, z, s, g)
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": group if group > 0 else None}
    return "compressed-tensors", qw.ct_config("pack-quantized" if packed else "int-quantized", weights,
                                              activations), layer


def _ct_fp8():
    def layer(w):
        s = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16).float()
        q = (w / s).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s}, q.float() * s
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    return "compressed-tensors", qw.ct_config("float-quantized", weights), layer


W8A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
# case -> (family, writer, INT4 layers kept as stored ("all" or "none"), HF runs the folder itself)
CASES = {
    "gptq-4bit-g32-asym-v1": ("llama", _gptq(4, 32, sym=False, v1=True), "all", False),
    "gptq-4bit-perchannel-sym-v2": ("qwen2", _gptq(4, -1, sym=True, v1=False), "all", False),
    "gptq-4bit-g32-actorder": ("llama", _gptq(4, 32, sym=False, v1=True, act_order=True), "none", False),
    "gptq-8bit-g32": ("qwen2", _gptq(8, 32, sym=True, v1=True), "none", False),
    "awq-gemm-g64": ("llama", _awq(64), "all", False),
    "awq-gemm-g128": ("qwen2", _awq(128), "all", False),
    "ct-w4a16-group-sym": ("llama", _ct_int(4, "group", sym=True, packed=True), "all", True),
    "ct-w4a16-channel-asym": ("qwen2", _ct_int(4, "channel", sym=False, packed=True), "all", False),
    "ct-w8a16-group": ("qwen2", _ct_int(8, "group", sym=True, packed=True), "none", True),
    "ct-w8a8-int-quantized": ("llama", _ct_int(8, "channel", sym=True, packed=False, activations=W8A8), "none",
                              False),
    "ct-fp8-channel": ("llama", _ct_fp8(), "none", True),
}


@pytest.fixture(scope="module")
def hf_tok(gguf_path: str):
    from engine.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path).hf_tokenizer


def _hf_model(family: str, vocab: int):
    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    extra = {"tie_word_embeddings": family == "qwen2"}
    if family == "qwen2":
        extra["use_sliding_window"] = False
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(cls(vocab_size=vocab, **SHAPE, **extra),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, hf_tok) -> dict:
    """case -> (folder, {checkpoint module: reference fp32 weight}, HF fp32 model holding the reference weights)."""
    import copy

    root, out = tmp_path_factory.mktemp("quantized"), {}
    base = {family: _hf_model(family, len(hf_tok)) for family in ("llama", "qwen2")}
    for case, (family, (method, config, layer), _, _) in CASES.items():
        model = copy.deepcopy(base[family])
        refs = qw.write_quantized(root / case, model, hf_tok, method, config, layer)
        with torch.no_grad():
            for module, w in refs.items():
                model.get_submodule(module).weight.copy_(w)
        out[case] = (root / case, refs, model)
    return out


@pytest.fixture(scope="module")
def prompt_ids(hf_tok, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    texts = gsm8k_questions[:NUM_PROMPTS // 2] + alpaca_instructions[:NUM_PROMPTS // 2]
    return [hf_tok.encode(hf_tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False) for t in texts]


@pytest.mark.parametrize("case", CASES)
def test_weights_equal_the_reference_bit_for_bit(case: str, folders) -> None:
    from engine.loading.quantized import read_state
    from engine.quant.qparams import Int4Weight

    folder, refs, _ = folders[case]
    _, plain = read_state(str(folder), "none", 128)
    _, auto = read_state(str(folder), "auto", 128)
    kept = 0
    for module, ref in refs.items():
        name = module.removeprefix("model.")
        assert torch.equal(plain[f"{name}.weight"], ref), name
        stored = auto.get(name, auto.get(f"{name}.weight"))
        kept += isinstance(stored, Int4Weight)
        assert torch.equal(stored.dequantize() if isinstance(stored, Int4Weight) else stored, ref), name
    assert kept == (len(refs) if CASES[case][2] == "all" else 0)


def test_compressed_tensors_asym_matches_its_decompressor(folders) -> None:
    """The asymmetric pack-quantized folder, unpacked by compressed-tensors' own decompressor (transformers 5.24 cannot
    load packed zero points: a shape mismatch), gives our weights bit for bit."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    from engine.loading.quantized import read_state

    folder, refs, _ = folders["ct-w4a16-channel-asym"]
    tensors = load_file(str(folder / "model.safetensors"))
    group = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    _, ours = read_state(str(folder), "none", 128)
    for module in refs:
        parts = {k.removeprefix(f"{module}."): v for k, v in tensors.items() if k.startswith(f"{module}.weight_")}
        theirs = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
        assert torch.equal(ours[f"{module.removeprefix('model.')}.weight"], theirs.float()), module


def _hf_argmax(model, prompt_ids: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """HF's greedy choice at each output position given the prompt and our earlier tokens (teacher forcing; equal to
    `outputs` exactly when HF's own greedy generation is: tests/engine/model/test_families.py)."""
    with torch.no_grad():
        return [model(torch.tensor([ids + seq])).logits[0, len(ids) - 1:-1].argmax(-1).tolist()
                for ids, seq in zip(prompt_ids, outputs, strict=True)]


@pytest.mark.parametrize("case", ["gptq-4bit-g32-asym-v1", "gptq-4bit-perchannel-sym-v2", "gptq-4bit-g32-actorder",
                                  "awq-gemm-g64", "ct-w4a16-group-sym", "ct-w8a16-group", "ct-fp8-channel"])
def test_greedy_matches_hf(case: str, folders, prompt_ids) -> None:
    folder, _, reference = folders[case]
    if CASES[case][3]:  # transformers runs the compressed-tensors folder itself (decompressed to fp32)
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(
                run_compressed=False)).eval()
    config = EngineConfig(device="cpu", dtype="float32", quantization="auto", num_kv_blocks=512, block_size=16,
                          max_num_seqs=16, max_num_batched_tokens=512)
    engine = LLMEngine.from_model(str(folder), config)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    ours = [o.output_token_ids for o in outs]
    assert len({t for r in ours for t in r}) > 60, "degenerate random model"
    assert _hf_argmax(reference, prompt_ids, ours) == ours


def _copy_with_config(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "exl2", "marlin"])
def test_unknown_quant_method_is_refused(method: str, folders, tmp_path: Path) -> None:
    from jobs.errors import JobError
    from jobs.preflight import check_model

    folder = _copy_with_config(folders["gptq-4bit-g32-asym-v1"][0], tmp_path / "m",
                               lambda c: c["quantization_config"].update(quant_method=method))
    with pytest.raises(JobError) as e:
        check_model(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and "quantization_config.quant_method" in msg and repr(method) in msg
    assert "gptq, awq, compressed-tensors" in msg


def test_gptq_tensors_without_quantization_config_are_refused(folders, tmp_path: Path) -> None:
    from jobs.errors import JobError
    from jobs.preflight import check_model

    folder = _copy_with_config(folders["gptq-4bit-g32-asym-v1"][0], tmp_path / "m",
                               lambda c: c.pop("quantization_config"))
    with pytest.raises(JobError) as e:
        check_model(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and "GPTQ-style tensors" in msg and "no quantization_config" in msg


def test_load_report_names_dequantized_layers(folders) -> None:
    from engine.loading.hf_folder import iter_hf_quantized_state, read_hf_config

    folder = str(folders["gptq-4bit-g32-actorder"][0])
    items, report = iter_hf_quantized_state(folder, read_hf_config(folder), torch.float32, keep_int4=True)
    dict(items)
    assert not report.int4 and len(report.dequantized) == 14
    assert "act-order" in report.summary() and "gptq 4-bit, group 32" in report.summary()
