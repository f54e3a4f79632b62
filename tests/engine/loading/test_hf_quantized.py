"""Quantized Hugging Face folders (issue 42): GPTQ, AWQ GEMM and compressed-tensors checkpoints load with weights
equal bit for bit to the format's reference dequantization, their 4-bit layers kept as stored INT4 where exact, and
run greedy token-identical to HF transformers (on the folder itself where transformers runs it on the CPU:
compressed-tensors; else on the exactly dequantized fp32 model) on 16 real prompts x 32 tokens; unknown methods and
GPTQ tensors without a quantization_config are refused before any work.

The folders are tiny random Llama / Qwen2 models (tests/engine/loading/quant_writers.py packs them as the producers
do; compressed-tensors through its own pack_to_int32; the cases: quant_cases.py; the fixtures: conftest.py). The
kernels they load into (act-order INT4, stored W8A8 INT8), the load report and the modes refused:
test_hf_quantized_kernels.py.
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
from quant_cases import CASES, hf_argmax  # noqa: E402

MAX_TOKENS = 32
pytestmark = pytest.mark.usefixtures("quant_cache_dir")


@pytest.mark.parametrize("case", CASES)
def test_weights_equal_the_reference_bit_for_bit(case: str, folders) -> None:
    from engine.loading.quantized import read_state
    from engine.quant.int8_linear import int8_available, int8_weight_qmax
    from engine.quant.qparams import Int4Weight, Int8Weight

    folder, refs, _ = folders[case]
    _, plain = read_state(str(folder), "none", 128)
    _, auto = read_state(str(folder), "auto", 128)
    kept = {"int4": 0, "int8": 0}
    for module, ref in refs.items():
        name = module.removeprefix("model.")
        assert torch.equal(plain[f"{name}.weight"], ref), name
        stored = auto.get(name, auto.get(f"{name}.weight"))
        if isinstance(stored, Int4Weight | Int8Weight):
            kept["int4" if isinstance(stored, Int4Weight) else "int8"] += 1
            stored = stored.dequantize()
        assert torch.equal(stored, ref), name
    expected = CASES[case][2]
    if case == "ct-w8a8-int-quantized" and not (int8_available() and int8_weight_qmax() >= 127):
        # per-channel symmetric scales put each row's largest weight at +-127: beyond what a CPU without VNNI sums
        # exactly (63), so there the layers are dequantized exactly (both kinds: test_hf_quantized_kernels.py)
        expected = "none"
    assert kept == {kind: len(refs) if kind == expected else 0 for kind in kept}


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
    assert (": 14 layers INT4 as stored" in engine.quantization_loaded) == (CASES[case][2] == "int4")
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    ours = [o.output_token_ids for o in outs]
    assert len({t for r in ours for t in r}) > 60, "degenerate random model"
    assert hf_argmax(reference, prompt_ids, ours) == ours


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
    from jobs.plan.preflight import check_model

    folder = _copy_with_config(folders["gptq-4bit-g32-asym-v1"][0], tmp_path / "m",
                               lambda c: c["quantization_config"].update(quant_method=method))
    with pytest.raises(JobError) as e:
        check_model(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and "quantization_config.quant_method" in msg and repr(method) in msg
    assert "gptq, awq, compressed-tensors" in msg


def test_gptq_tensors_without_quantization_config_are_refused(folders, tmp_path: Path) -> None:
    from jobs.errors import JobError
    from jobs.plan.preflight import check_model

    folder = _copy_with_config(folders["gptq-4bit-g32-asym-v1"][0], tmp_path / "m",
                               lambda c: c.pop("quantization_config"))
    with pytest.raises(JobError) as e:
        check_model(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and "GPTQ-style tensors" in msg and "no quantization_config" in msg
