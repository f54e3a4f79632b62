"""The preflight's fit check (jobs.plan.model_fit, issue 42): model bytes on the device, KV bytes per token, the KV pool
left and the sequences of --max-model-len it holds, from the model's header alone; a model that cannot hold one
sequence is exit 2 naming the numbers and the ways out. A GPU is simulated where the test needs one (its memory as
nvidia-smi would report it): the arithmetic is what is tested, not the card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine import EngineConfig
from engine.worker.memory_fit import INT4_DUAL_MIN_KV_SHARE
from jobs.cli import app
from jobs.errors import JobError
from jobs.plan.model_fit import check_fit, model_fit
from jobs.plan.preflight import model_context

GIB = 1 << 30
# Llama-3.1-70B's config.json (meta-llama/Llama-3.1-70B-Instruct), the shape that needs INT4 on one GPU.
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
             "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
             "torch_dtype": "bfloat16"}
LLAMA_70B_PARAMS = 128256 * 8192 * 2 + 80 * (8192 * 8192 * 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) + 8192


def _gpu(monkeypatch: pytest.MonkeyPatch, gib: int, name: str) -> None:
    """This machine as one with an idle CUDA card of `gib` GiB."""
    import jobs.plan.model_fit

    monkeypatch.setattr(jobs.plan.model_fit, "resolve_device", lambda device: jobs.plan.model_fit.Device("cuda", 0))
    monkeypatch.setattr(jobs.plan.model_fit, "_cuda_memory", lambda index: (gib * GIB, gib * GIB, name))


@pytest.fixture
def llama_70b(tmp_path: Path) -> str:
    """A folder with Llama-3.1-70B's config.json (the fit check reads no weights)."""
    folder = tmp_path / "Llama-3.1-70B-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))
    (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


def test_the_numbers_of_the_default_model_are_the_loaded_ones(real_engine, gguf_path: str) -> None:
    """fp32 on the CPU: the weights' bytes the check states are the bytes of the loaded model's tensors (before the
    engine's CPU kernels repack them), the KV bytes per token the engine's pool's."""
    from engine.loading.open_model import open_model

    fit = check_fit(gguf_path, EngineConfig(device="cpu", dtype="float32", max_model_len=4096),
                    model_context(gguf_path))
    model = open_model(gguf_path, torch.float32, torch.device("cpu"), tokenizer=False).model
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    assert fit.model_bytes == sum(tensors.values())
    cache = real_engine.runner.kv_caches
    pool_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in cache)
    assert fit.kv_bytes_per_token == pool_bytes // (real_engine.num_kv_blocks * real_engine.block_size)
    assert fit.sequences == fit.pool_tokens // 4096 >= 1
    assert f"{fit.sequences:,} concurrent sequences of --max-model-len 4,096" in fit.line()


def test_a_70b_in_bf16_is_refused_on_an_80_gib_gpu_with_the_ways_out(llama_70b: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, 80, "NVIDIA H100 80GB HBM3")
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=8192)
    fit = model_fit(llama_70b, config, model_context(llama_70b))
    assert fit.model_bytes == LLAMA_70B_PARAMS * 2 and fit.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # 320 KiB
    assert fit.memory_bytes == int(80 * GIB * 0.9) and fit.kv_pool_bytes < 0 and fit.sequences == 0
    with pytest.raises(JobError) as e:
        check_fit(llama_70b, config, model_context(llama_70b))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("--model Llama-3.1-70B-Instruct does not fit one sequence of --max-model-len 8,192 tokens "
                           "on cuda:0 (NVIDIA H100 80GB HBM3, 80.0 GiB, gpu_memory_utilization 0.9): 72.00 GiB "
                           "usable, the weights take 131.42 GiB, the KV cache 320.0 KiB per token")
    assert "Ways out: --quantization int4 (weights about " in line and "a device with at least" in line


def _int4_bytes(cfg: dict, copies: int) -> int:
    """Device bytes of `cfg`'s weights under --quantization int4 g128 on CUDA: the embedding and the norms in bf16,
    every projection and the (untied) LM head 0.5 byte per weight plus a bf16 scale and zero per group of 128, times
    the packed copies."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    linear = layers * (2 * h * h + 2 * h * kv + 3 * h * cfg["intermediate_size"]) + vocab * h
    return vocab * h * 2 + h * (2 * layers + 1) * 2 + copies * (linear // 2 + linear // 128 * 4)


@pytest.mark.parametrize("gib, name", [(80, "NVIDIA H100 80GB HBM3"), (141, "NVIDIA H200")])
def test_int4_of_a_70b_holds_one_packed_copy_and_fits_an_h100(llama_70b: str, monkeypatch: pytest.MonkeyPatch,
                                                              gib: int, name: str) -> None:
    """INT4 weights count as the engine holds them on CUDA (engine.worker.memory_fit.choose_int4_layout): a 70B
    takes one packed copy ("single", GemLite alone), since a second would leave 0.28 GiB of KV on an 80 GiB H100
    (912 tokens: not one sequence) and 62% of the one-copy pool on a 141 GiB H200 (under INT4_DUAL_MIN_KV_SHARE)."""
    _gpu(monkeypatch, gib, name)
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=8192, quantization="int4",
                          int4_group_size=128)
    fit = check_fit(llama_70b, config, model_context(llama_70b))
    assert fit.int4_layout == "single" and fit.model_bytes == _int4_bytes(LLAMA_70B, 1)
    assert fit.kv_pool_bytes == int(gib * GIB * 0.9) - fit.model_bytes - 2048 * 128256 * 4 - 16 * fit.kv_bytes_per_token
    assert fit.sequences == fit.kv_pool_bytes // (8192 * fit.kv_bytes_per_token) >= (13 if gib == 80 else 35)
    assert "(INT4 layout single)" in fit.line()
    dual = int(gib * GIB * 0.9) - _int4_bytes(LLAMA_70B, 2) - 2048 * 128256 * 4 - 16 * fit.kv_bytes_per_token
    assert dual < INT4_DUAL_MIN_KV_SHARE * fit.kv_pool_bytes


def test_int4_keeps_two_copies_where_the_second_costs_little_kv(llama_70b: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An 8B shape on an H100 keeps tinygemm's copy beside GemLite's ("dual": the second copy takes 6% of the KV
    pool); a 70B on an H200 does too when the pool with both still holds every sequence the engine may run at once
    (max_num_seqs x max_model_len)."""
    llama_8b = {**LLAMA_70B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32}
    Path(llama_70b, "config.json").write_text(json.dumps(llama_8b))
    _gpu(monkeypatch, 80, "NVIDIA H100 80GB HBM3")
    config = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=4096, quantization="int4")
    fit = model_fit(llama_70b, config, model_context(llama_70b))
    assert fit.int4_layout == "dual" and fit.model_bytes == _int4_bytes(llama_8b, 2)
    Path(llama_70b, "config.json").write_text(json.dumps(LLAMA_70B))
    _gpu(monkeypatch, 141, "NVIDIA H200")
    few = EngineConfig(device="cuda", dtype="bfloat16", max_model_len=4096, quantization="int4", max_num_seqs=8)
    fit = model_fit(llama_70b, few, model_context(llama_70b))
    assert fit.int4_layout == "dual" and fit.model_bytes == _int4_bytes(LLAMA_70B, 2)
    assert fit.kv_pool_bytes >= 8 * 4096 * fit.kv_bytes_per_token


def test_the_fit_check_counts_the_weights_the_engine_loads(gguf_path: str) -> None:
    """The weights the engine's INT4 layout choice sees at load (engine.loading.open_model.open_model's int4_layout
    chooser: numel and INT4 group per weight) are the ones the fit check counts from the GGUF header, and the
    layout chosen is the one every Int4Linear gets."""
    from engine.loading.open_model import open_model
    from engine.quant.int4_linear import Int4Linear
    from jobs.plan.model_fit import _weights

    seen: list[list[tuple[int, int | None]]] = []

    def choose(cfg: object, tensors: list[tuple[int, int | None]]) -> str:
        seen.append(tensors)
        return "single"

    loaded = open_model(gguf_path, torch.float32, torch.device("cpu"), quantization="auto", int4_layout=choose)
    assert len(seen) == 1 and loaded.int4_layout == "single"
    assert sorted(seen[0], key=str) == sorted(_weights(gguf_path, "auto", 128)[0], key=str)
    mods = [m for m in loaded.model.modules() if isinstance(m, Int4Linear)]
    assert len(mods) == loaded.num_int4_modules == sum(g is not None for _, g in seen[0]) == 210
    assert {m.layout for m in mods} == {"single"}


def test_the_cli_refuses_before_any_work_in_one_line(tmp_path: Path, gsm8k_questions: list[str], gguf_path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with less memory available than the model's weights: exit 2, one line, OUTPUT never created."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import jobs.plan.model_fit

    monkeypatch.setattr(jobs.plan.model_fit, "memory_available_bytes", lambda: 300 << 20)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"question": gsm8k_questions[:2]}), src)
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", str(src), str(out), "--prompt-column", "question", "--device", "cpu",
                                   "--dtype", "float32", "--kv-cache-gib", "0.5", "--max-model-len", "2048",
                                   "--model", gguf_path])
    assert res.exit_code == 2, res.output
    line = " ".join(res.stderr.split())  # rich wraps the line at the terminal's width
    assert ("--model SmolLM2-135M-Instruct.Q4_1.gguf does not fit one sequence of --max-model-len 2,048 tokens on cpu: "
            "0.29 GiB usable, the weights take 0.50 GiB") in line and "Ways out: --quantization int4" in line
    assert not out.exists()


def test_the_client_resolves_device_and_dtype_as_the_engine_does() -> None:
    """The client decides without torch (nvidia-smi, /proc/cpuinfo's flags) what the engine decides with it: the
    same device, the same run dtype, the same element sizes."""
    from engine.kernels.cpu_features import cpu_flags_native_bf16
    from engine.worker.device import cpu_has_native_bf16
    from engine.worker.device import resolve_device as engine_device
    from engine.worker.device import resolve_dtype as engine_dtype
    from engine.worker.memory_fit import dtype_bytes
    from jobs.plan.model_fit import resolve_device, resolve_dtype

    assert cpu_flags_native_bf16() == cpu_has_native_bf16()
    for name in ("auto", "cpu"):
        ours, theirs = resolve_device(name), engine_device(name)
        assert (ours.type, ours.index, str(ours)) == (theirs.type, theirs.index, str(theirs))
        for dtype in ("auto", "float32", "bfloat16", "float16"):
            torch_dtype = engine_dtype(dtype, theirs)
            assert resolve_dtype(dtype, ours) == str(torch_dtype).removeprefix("torch.")
            assert dtype_bytes(resolve_dtype(dtype, ours)) == dtype_bytes(torch_dtype) == torch_dtype.itemsize
    with pytest.raises(ValueError, match="no run dtype 'int8'"):
        dtype_bytes(torch.int8)
