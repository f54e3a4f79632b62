"""bench/big_checkpoint.py writes a GPTQ checkpoint the loader reads as GPTQ (issue 42), checked on the tiny shape
only: sharded with an index, every projection's integers unpacked here independently of the loader give the weights
the loader builds (W = (q - 8) * s, v1 zeros), the INT4 path keeps them INT4, and greedy text is the same either way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import big_checkpoint  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-gptq")
    done = big_checkpoint.write_checkpoint(str(out), "tiny", shard_gb=0.02)
    assert done["files"] >= 2
    return out


def _unpack_gptq(qweight: torch.Tensor, scales: torch.Tensor, zeros: int = 8) -> torch.Tensor:
    """W fp32 [N, K] from GPTQ qweight int32 [K / 8, N] (input feature 8 w + j in bits 4 j of word [w, n]) and fp16
    scales [K / 128, N]."""
    words = qweight.long() & 0xFFFFFFFF
    q = torch.stack([(words >> (4 * j)) & 15 for j in range(8)], dim=1).reshape(-1, qweight.shape[1])  # [K, N]
    return ((q - zeros).float() * scales.float().repeat_interleave(128, dim=0)).t()


def test_the_writer_follows_the_gptq_format(folder: Path) -> None:
    from safetensors.torch import load_file

    from engine.loading.hf_folder import check_hf_folder
    from engine.loading.open_model import open_model

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"] == {**big_checkpoint.QUANTIZATION_CONFIG}
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2 and all((folder / f).is_file() for f in index.values())
    check_hf_folder(str(folder))  # names and quantization_config as the engine reads them
    tensors = {}
    for f in set(index.values()):
        tensors.update(load_file(str(folder / f)))
    assert tensors["model.layers.0.self_attn.q_proj.qweight"].dtype == torch.int32
    assert tensors["model.layers.1.mlp.down_proj.qweight"].shape == (512 // 8, 256)
    assert (tensors["model.layers.0.mlp.up_proj.qzeros"] == 0x77777777).all()
    plain = open_model(str(folder), torch.float32, CPU, quantization="none").model
    for module in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        p = f"model.layers.1.{module}"
        want = _unpack_gptq(tensors[f"{p}.qweight"], tensors[f"{p}.scales"])
        got = plain.get_submodule(f"layers.1.{module}").weight
        assert torch.equal(got, want), module
    assert want.std().item() == pytest.approx(0.02, rel=0.3)


def test_int4_keeps_the_layers_and_the_greedy_tokens(folder: Path, gsm8k_questions: list[str]) -> None:
    from engine.loading.open_model import open_model

    assert open_model(str(folder), torch.float32, CPU, quantization="auto").num_int4_modules == 2 * 7
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for q in ("none", "auto"):
        engine = LLMEngine.from_model(str(folder), EngineConfig(device="cpu", dtype="float32", quantization=q))
        outs[q] = [o.output_token_ids for o in engine.generate(gsm8k_questions[:2], params)]
    assert outs["auto"] == outs["none"] and all(len(set(r)) > 1 for r in outs["none"])
