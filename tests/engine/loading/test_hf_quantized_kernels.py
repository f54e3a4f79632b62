"""Quantized HF folders into our kernels with their stored integers (issue 42): GPTQ act-order layers stay INT4 with
their input features permuted once at load, a compressed-tensors W8A8 folder runs its int8 weights on the CPU's INT8
kernel (or, beyond what this CPU's int8 GEMM sums exactly, dequantized exactly), modes that would quantize such a
folder a second time are refused in one line, and what was kept or dequantized is said: the load report, the
engine's `quantization_loaded` and the shard's accounting row.

The folders and fixtures: conftest.py and quant_cases.py beside this file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from quant_cases import hf_argmax  # noqa: E402
from quant_writers import PROJECTIONS  # noqa: E402

MAX_TOKENS = 32
pytestmark = pytest.mark.usefixtures("quant_cache_dir")
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=16,
              max_num_batched_tokens=512)


def test_act_order_layers_keep_int4_with_their_input_permuted(folders) -> None:
    """GPTQ act-order (g_idx not k // group): the INT4 weight holds the checkpoint's columns sorted by group, and
    the fused QKV / gate-up modules share the one order their parts have (as GPTQ gives parts of one input). The
    weights equal the reference bit for bit and greedy equals HF: test_hf_quantized.py."""
    from engine.loading.quantized import read_state
    from engine.quant.int4_linear import Int4Linear
    from engine.quant.qparams import Int4Weight

    folder, refs, _ = folders["gptq-4bit-g32-actorder"]
    _, state = read_state(str(folder), "auto", 128)
    for module in refs:
        w = state[module.removeprefix("model.")]
        assert isinstance(w, Int4Weight) and w.in_perm is not None and w.group_size == 32
        assert not torch.equal(w.in_perm, torch.arange(w.in_features))
    engine = LLMEngine.from_model(str(folder), EngineConfig(quantization="auto", **ENGINE))
    layer = engine.runner.model.layers[0]
    for fused in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert isinstance(fused, Int4Linear) and fused.in_perm is not None
    # parts that take their input in different orders are not fused (each gathers its own)
    a, b = state["layers.0.self_attn.q_proj"], state["layers.0.self_attn.k_proj"]
    other = Int4Weight(b.qweight, b.scales, b.zeros, b.in_features, b.group_size, torch.flip(b.in_perm, [0]))
    mods = [Int4Linear(a, torch.float32, "cpu"), Int4Linear(other, torch.float32, "cpu")]
    assert Int4Linear.concat(mods) is None
    x = torch.randn(3, a.in_features)
    torch.testing.assert_close(mods[1](x), x @ other.dequantize().T, rtol=1e-5, atol=1e-5)


def _stored_int8(folder: Path, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(f"{module}.weight"), f.get_tensor(f"{module}.weight_scale").float().reshape(-1)


def test_w8a8_folder_runs_as_the_cpu_can_and_matches_hf_running_the_same_arithmetic(folders, prompt_ids,
                                                                                       int8_qmax: float) -> None:
    """compressed-tensors int-quantized W8A8 (int8 weights per channel, int8 activations per token, dynamic), on both
    CPU kinds (the int8_qmax fixture):
    - where the int8 GEMM sums |q| <= 127 exactly (VNNI): the CPU's INT8 kernel with the checkpoint's integers and
      scales as they are; greedy equals HF transformers on the exactly dequantized weights with each projection's
      input quantized per token as the kernel does (s = max|x| / 127, round(x / s) * s; vLLM's dynamic per-token
      scheme);
    - elsewhere (63 without VNNI; the stored integers reach 127): every layer dequantized exactly, never re-rounded to
      7 bits, the load saying why; greedy equals HF on those weights, activations unrounded.
    Teacher forcing, 16 prompts x 32 tokens."""
    from engine.quant.int8_linear import Int8Linear

    folder, _, reference = folders["ct-w8a8-int-quantized"]
    engine = LLMEngine.from_model(str(folder), EngineConfig(quantization="auto", **ENGINE))
    qkv = engine.runner.model.layers[1].self_attn.qkv_proj
    hooks = []
    if int8_qmax >= 127:
        assert isinstance(qkv, Int8Linear) and qkv.source is not None
        parts = [_stored_int8(folder, f"model.layers.1.self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(qkv.source.qweight, torch.cat([q for q, _ in parts]))
        assert torch.equal(qkv.source.scale, torch.cat([s for _, s in parts]))
        assert engine.quantization_loaded.endswith("14 layers INT8 as stored (W8A8), 0 dequantized exactly")

        def per_token_int8(module, args):
            x = args[0]
            s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
            return (torch.round(x / s) * s,)

        hooks = [m.register_forward_pre_hook(per_token_int8) for name, m in reference.named_modules()
                 if name.rsplit(".", 1)[-1] in PROJECTIONS]
    else:
        assert not isinstance(qkv, Int8Linear)
        assert engine.quantization_loaded.endswith(
            "0 layers INT4 as stored, 14 dequantized exactly (int8 weights beyond this CPU's INT8 limit (|q| <= 63 "
            "without VNNI): 14)")
    try:
        outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        ours = [o.output_token_ids for o in outs]
        assert len({t for r in ours for t in r}) > 60, "degenerate random model"
        assert hf_argmax(reference, prompt_ids, ours) == ours
    finally:
        for h in hooks:
            h.remove()


def test_w8a8_beyond_the_cpus_int8_limit_is_dequantized_exactly_and_said(folders, monkeypatch) -> None:
    """A CPU without VNNI sums |q_w| <= 63 exactly (engine.quant.int8_linear): stored weights beyond that are
    dequantized exactly, never re-rounded to 7 bits, and the report says why."""
    import engine.quant.int8_linear as int8_linear
    from engine.loading.quantized import read_model_state
    from engine.quant.qparams import Int8Weight

    if not int8_linear.int8_available():
        pytest.skip("torch has no oneDNN int8 ops here")
    folder, refs, _ = folders["ct-w8a8-int-quantized"]
    monkeypatch.setattr(int8_linear, "int8_weight_qmax", lambda: 63.0)
    _, state, report = read_model_state(str(folder), "auto", 128)
    for module, ref in refs.items():
        assert torch.equal(state[f"{module.removeprefix('model.')}.weight"], ref)
    assert report.endswith("0 layers INT4 as stored, 14 dequantized exactly (int8 weights beyond this CPU's INT8 "
                           "limit (|q| <= 63 without VNNI): 14)")
    q, s = _stored_int8(folder, "model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="beyond the 63 this CPU's int8 GEMM sums exactly"):
        int8_linear.Int8Linear(Int8Weight(q, s), torch.float32)


@pytest.mark.parametrize(("case", "mode"), [("gptq-4bit-g32-asym-v1", "int4"), ("gptq-4bit-g32-asym-v1", "int8"),
                                            ("awq-gemm-g64", "int8"), ("ct-w8a8-int-quantized", "int4"),
                                            ("ct-w4a16-group-sym", "int8")])
def test_modes_that_would_quantize_a_quantized_folder_again_are_refused(case: str, mode: str, folders) -> None:
    from engine.loading.quantized import read_state
    from engine.ptq.to_folder import quantize_to_folder
    from jobs.errors import JobError
    from jobs.plan.preflight import check_quantization

    folder = str(folders[case][0])
    method = "compressed-tensors" if case.startswith("ct-") else case.split("-")[0]
    with pytest.raises(JobError) as e:  # the CLI's preflight: exit 2 before any work
        check_quantization(folder, mode)
    with pytest.raises(ValueError) as v:  # the engine, for a model that reached it another way
        read_state(folder, mode, 128)
    for msg in (str(e.value), str(v.value)):
        assert "\n" not in msg and f"quant_method {method!r}" in msg and "second time" in msg
        assert "'auto'" in msg and "'none'" in msg
    with pytest.raises(ValueError, match="second time"):  # `tokenmill quantize` does not quantize it again either
        quantize_to_folder(folder, "/nonexistent/out", bits=4)
    check_quantization(folder, "auto")
    check_quantization(folder, "none")


def test_int8_mode_on_a_w8a8_folder_keeps_its_stored_integers_where_the_cpu_sums_them(folders,
                                                                                        int8_qmax: float) -> None:
    """`quantization int8` on a W8A8 folder never quantizes it a second time: its integers kept as stored where this
    CPU's int8 GEMM sums them exactly (VNNI), else each layer dequantized exactly and the report says why."""
    from engine.loading.quantized import read_model_state
    from engine.quant.qparams import Int8Weight
    from jobs.plan.preflight import check_quantization

    folder, refs, _ = folders["ct-w8a8-int-quantized"]
    check_quantization(str(folder), "int8")
    _, state, report = read_model_state(str(folder), "int8", 128)
    for module, ref in refs.items():
        name = module.removeprefix("model.")
        if int8_qmax >= 127:
            assert isinstance(state[name], Int8Weight) and torch.equal(state[name].dequantize(), ref)
        else:
            assert name not in state and torch.equal(state[f"{name}.weight"], ref)
    assert ("14 layers INT8 as stored" if int8_qmax >= 127 else
            "14 dequantized exactly (int8 weights beyond this CPU's INT8 limit (|q| <= 63 without VNNI): 14)") in report


def test_the_load_report_names_what_was_dequantized_and_why(folders) -> None:
    from engine.loading.quantized import read_model_state

    def report(case: str, mode: str = "auto") -> str:
        return read_model_state(str(folders[case][0]), mode, 128)[2]

    assert report("gptq-8bit-g32") == ("gptq 8-bit, group 32: 0 layers INT4 as stored, 14 dequantized exactly "
                                       "(8-bit weights (the INT4 kernels hold 4 bits): 14)")
    assert report("gptq-4bit-g32-actorder") == ("gptq 4-bit, group 32: 14 layers INT4 as stored (14 act-order, input "
                                                "permuted at load), 0 dequantized exactly")
    assert report("ct-fp8-channel") == ("compressed-tensors float-quantized float8 channel: 0 layers INT4 as stored, "
                                        "14 dequantized exactly (fp8 weights: 14)")
    assert report("awq-gemm-g64", "none") == ("awq 4-bit, group 64: 0 layers INT4 as stored, 14 dequantized exactly "
                                              "(quantization 'none' asked for dequantized: 14)")


def test_the_shards_accounting_names_the_quantization_as_loaded(folders, tmp_path: Path,
                                                                 gsm8k_questions: list[str]) -> None:
    """The accounting's quantization column (and so the job summary's "dtype / quantization" line, which lists its
    distinct values) carries the load report of an already quantized model after the engine's mode."""
    from jobs.summary import JobSummary, add_accounting
    from pipeline.config import RunConfig
    from pipeline.input import Shard
    from pipeline.layout import accounting_path
    from pipeline.shard import run_shard

    engine = LLMEngine.from_model(str(folders["gptq-4bit-g32-actorder"][0]),
                                  EngineConfig(quantization="auto", **ENGINE))
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": gsm8k_questions[:3]}), path)
    out = str(tmp_path / "out")
    row = run_shard(engine, Shard("00000-000000000", str(path), f"file://{path}", 0, 3), "prompt", out,
                    RunConfig(max_tokens=4))
    expected = ("auto (gptq 4-bit, group 32: 14 layers INT4 as stored (14 act-order, input permuted at load), 0 "
                "dequantized exactly)")
    assert row["quantization"] == expected
    stored = pq.read_table(accounting_path(out, "00000-000000000", 1)).column("quantization").to_pylist()
    assert stored == [expected]
    summary = JobSummary()
    add_accounting(summary, row)
    assert summary.quantizations == [expected]


def test_a_second_load_reads_the_converted_layers_from_the_weights_cache(folders, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-time conversion (INT4 repacked, act-order permuted, W8A8 int8 as stored, 8-bit GPTQ dequantized)
    lands in the weights cache: a second load reads the same state and report without converting; a changed file
    is a new entry; quantization 'none' is not cached (nothing is converted to keep)."""
    import os
    import shutil

    from engine.loading import quantized
    from engine.loading.quantized import read_model_state
    from engine.quant.qparams import Int4Weight, Int8Weight

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    cases = ("gptq-4bit-g32-actorder", "ct-w8a8-int-quantized", "gptq-8bit-g32")
    first = {case: read_model_state(str(folders[case][0]), "auto", 128) for case in cases}
    read_model_state(str(folders["awq-gemm-g64"][0]), "none", 128)
    assert len(list((tmp_path / "cache" / "weights").iterdir())) == len(cases)

    def no_conversion(*_a: object, **_k: object) -> None:
        raise AssertionError("a cached load must not convert the checkpoint again")

    def parts(v: object) -> list:
        if isinstance(v, Int4Weight):
            return [v.qweight, v.scales, v.zeros, v.in_features, v.group_size, v.in_perm]
        return [v.qweight, v.scale] if isinstance(v, Int8Weight) else [v]

    with monkeypatch.context() as m:
        m.setattr(quantized, "iter_hf_quantized_state", no_conversion)
        for case in cases:
            _, built, report = first[case]
            _, cached, cached_report = read_model_state(str(folders[case][0]), "auto", 128)
            assert cached_report == report and cached.keys() == built.keys()
            for name, v in built.items():
                assert type(cached[name]) is type(v), name
                for a, b in zip(parts(v), parts(cached[name]), strict=True):
                    assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name
    copy = tmp_path / "copy"
    shutil.copytree(folders["gptq-4bit-g32-actorder"][0], copy)
    read_model_state(str(copy), "auto", 128)
    config = copy / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    read_model_state(str(copy), "auto", 128)
    assert len(list((tmp_path / "cache" / "weights").iterdir())) == len(cases) + 2
