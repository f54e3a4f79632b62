"""Every tensor type of llama.cpp's Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16 and BF16 files loads exactly (issue 42): the
weights equal gguf-py's `gguf.quants.dequantize` bit for bit, greedy tokens on 16 real prompts x 32 tokens equal
those of the same model stored dequantized (F32 GGUF), and `quantization="auto"` keeps Q4_K projections INT4 (no
requantizing) with the same greedy tokens. The files: tests/gguf_models.py (tiny Llama, SmolLM2's
tokenizer)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

gguf = pytest.importorskip("gguf")
import gguf_models  # noqa: E402  (tests/, on sys.path through tests/conftest.py)

T = gguf.GGMLQuantizationType
NUM_PROMPTS, MAX_TOKENS = 16, 32
CPU = torch.device("cpu")
FP32 = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=16,
                    max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def tokenizer(gguf_path: str) -> tuple[tuple, ...]:
    from family_models import tokenizer_fields  # read once per test process

    return tokenizer_fields(gguf_path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tokenizer: list[tuple]) -> dict[str, tuple[Path, Path, dict]]:
    """mix -> (quantized GGUF, its F32 dequantization, {GGUF name: (stored array, type)})."""
    root = tmp_path_factory.mktemp("gguf-types")
    out = {}
    for seed, mix in enumerate(gguf_models.MIXES):
        tensors = gguf_models.write_tiny_llama(root / f"{mix}.gguf", gguf_models.MIXES[mix], tokenizer, seed=seed)
        gguf_models.write_dequantized(root / f"{mix}-f32.gguf", tensors, tokenizer)
        out[mix] = (root / f"{mix}.gguf", root / f"{mix}-f32.gguf", tensors)
    return out


@pytest.fixture(scope="module")
def prompt_ids(gguf_path: str, gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[list[int]]:
    from engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_path).hf_tokenizer
    texts = gsm8k_questions[:NUM_PROMPTS // 2] + alpaca_instructions[:NUM_PROMPTS // 2]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module", autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory):
    """The weights cache in a folder of the module's own (each file's metadata is parsed once: tests/engine/conftest.py
    `gguf_parsed_once`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def _engine(model: Path, config: EngineConfig = FP32) -> LLMEngine:
    return LLMEngine.from_model(str(model), config)


def _greedy(engine: LLMEngine, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(files, prompt_ids) -> dict[str, tuple[dict[str, torch.Tensor], list[list[int]]]]:
    """mix -> (state dict, greedy tokens) of its F32 file."""
    out = {}
    for mix, (_, f32, _) in files.items():
        engine = _engine(f32)
        out[mix] = (engine.runner.model.state_dict(), _greedy(engine, prompt_ids))
        assert all(len(r) == MAX_TOKENS and len(set(r)) >= 4 for r in out[mix][1]), "degenerate random model"
    return out


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy().view(np.int32)


@pytest.mark.parametrize("mix", list(gguf_models.MIXES))
def test_llama_cpp_types_load_exactly(mix: str, files, reference, prompt_ids) -> None:
    path, _, tensors = files[mix]
    types = {qtype.name for _, qtype in tensors.values()}
    assert types >= {"Q4_K", "Q6_K"} if mix == "Q4_K_M" else types >= {"Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "F16",
                                                                       "BF16"}
    engine = _engine(path)
    got, (want, want_tokens) = engine.runner.model.state_dict(), reference[mix]
    assert got.keys() == want.keys()
    for name in want:  # every weight: gguf-py's dequantization, bit for bit (Q/K rows un-permuted alike)
        np.testing.assert_array_equal(_bits(got[name]), _bits(want[name]), err_msg=name)
    assert _greedy(engine, prompt_ids) == want_tokens  # fp32, GGUF blocks read by the small-batch kernel


def test_auto_keeps_q4_k_projections_int4(files, reference, prompt_ids) -> None:
    """Q4_K projections load as INT4 (the super-block's eight groups of 32 map onto group-32 INT4 with no
    requantizing); Q6_K ones are dequantized; greedy tokens stay the dequantized model's."""
    from engine.loading.quantized import read_state
    from engine.quant.int4_linear import Int4Linear
    from engine.quant.qparams import Int4Weight

    path, _, tensors = files["Q4_K_M"]
    _, state = read_state(str(path), "auto", 128)
    int4 = sorted(n for n, w in state.items() if isinstance(w, Int4Weight))
    q4_k = [n for n, (_, qtype) in tensors.items() if qtype == T.Q4_K and n.startswith("blk.")]
    assert len(int4) == len(q4_k) == gguf_models.LAYERS * 5 and all(state[n].group_size == 32 for n in int4)
    assert "layers.0.self_attn.v_proj.weight" in state  # Q6_K: no exact INT4 form, dequantized
    engine = _engine(path, dataclasses.replace(FP32, quantization="auto"))
    assert any(isinstance(m, Int4Linear) for m in engine.runner.model.modules())
    assert _greedy(engine, prompt_ids) == reference["Q4_K_M"][1]


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0, T.F16, T.BF16,
                                   T.F32, T.MXFP4], ids=lambda t: t.name)
def test_dequantize_tensor_in_chunks_is_gguf_py_bit_for_bit(qtype, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.loading.gguf_file.dequantize_tensor (row chunks on threads) against one gguf-py call, for a tensor
    read back from a file; chunks of 16 rows here, so 300 rows take 19 of them, the last one short."""
    from engine.loading import gguf_file

    monkeypatch.setattr(gguf_file, "_DEQUANT_CHUNK", 16 * 512)
    rng = np.random.default_rng(int(qtype))
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    a = gguf_models.random_tensor(qtype, 300, 512, 0.1, rng)
    w.add_tensor("w", np.ascontiguousarray(a), raw_dtype=None if qtype == T.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf_file.open_gguf(str(tmp_path / "t.gguf")).tensors[0]
    got = gguf_file.dequantize_tensor(t)
    want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    assert got.shape == want.shape == (300, 512) and got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    assert np.isfinite(got).all() and got.std() > 0.01


def test_a_type_gguf_py_cannot_read_is_one_line() -> None:
    from engine.loading.gguf_file import dequantize_tensor

    tensor = SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=T.Q8_K, shape=(256, 4),
                             data=np.zeros((4, 292), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has type Q8_K, which the gguf package cannot "
                                         r"dequantize; convert the model"):
        dequantize_tensor(tensor)
