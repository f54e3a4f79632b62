"""The BERT encoder (engine.model.bert) against HF transformers' own BertModel: a tiny random-weight model saved with
save_pretrained, loaded by LLMEngine from that folder, fed variable-length real texts (packed, no padding) vs HF's
padded batch with its attention mask: last hidden states within 1e-4 in fp32; without sentence-transformers files
the folder pools by mean, unnormalized (sentence-transformers' rule for a plain Hugging Face model)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.layers.encoder_attention import EncoderMetadata

MAX_POSITIONS = 96  # below the tokenizer's 512: the folder's texts truncate at the model's positions


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory, minilm_folder: str) -> tuple[Path, object]:
    """A 3-layer BERT of random weights (HF BertModel, hidden 128, 4 heads of 32 as all-MiniLM's, the MiniLM vocabulary)
    saved to a folder with the MiniLM tokenizer beside it; the HF model itself."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=MAX_POSITIONS, type_vocab_size=2)
    model = BertModel(cfg, add_pooling_layer=True).eval()
    with torch.no_grad():  # weights of O(1) activations (HF's init, std 0.02, hides a wrong GELU), LayerNorms away
        for name, p in model.named_parameters():  # from their init (1, 0): a wrong block shows
            p.add_(torch.randn_like(p) * (0.2 if "LayerNorm" in name or p.dim() == 1 else 0.1))
    folder = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(minilm_folder) / name, folder / name)
    return folder, model


@pytest.fixture(scope="module")
def texts(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    """24 real texts of 10 to over 96 tokens."""
    return [t for pair in zip(gsm8k_questions[:12], alpaca_instructions[180:192], strict=True) for t in pair]


@pytest.mark.parametrize("avx512", [True, False], ids=["oneDNN-packed", "MKL"])
def test_hidden_states_equal_hf_bert(tiny_bert: tuple[Path, object], texts: list[str], avx512: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Both fp32 paths, whatever this CPU: oneDNN-packed linears with the GELU in the epilogue and torch's SDPA
    (AVX-512 CPUs), and MKL's sgemm with our C++ encoder kernels after it (AVX2-only CPUs: attention from the packed
    QKV, bias + GELU, bias + residual + LayerNorm; engine.quant.after_load.mkl_serves_better,
    engine.kernels.cpu_kernels.encoder_fp32_ops)."""
    from engine.kernels import cpu_kernels
    from engine.layers.encoder_attention import packed_kernel
    from engine.quant import after_load, packed_linear

    monkeypatch.setattr(after_load, "cpu_has_avx512", lambda: avx512)
    monkeypatch.setattr(packed_linear, "cpu_has_avx512", lambda: avx512)
    monkeypatch.setattr(cpu_kernels, "cpu_has_avx512", lambda: avx512)
    folder, hf = tiny_bert
    engine = LLMEngine.from_model(str(folder), EngineConfig(device="cpu", dtype="float32"))
    dense = engine.model.encoder.layer[0].intermediate.dense
    if packed_linear.packing_available():
        assert type(dense).__name__ == ("PackedLinear" if avx512 else "Linear")
        assert getattr(dense, "gelu_epilogue", False) is avx512
    rows = [ids for ids, _ in engine.tokenizer.encode_truncated(texts, MAX_POSITIONS)]
    lens = [len(r) for r in rows]
    assert min(lens) < 30 and max(lens) == MAX_POSITIONS  # variable length, some truncated at the positions
    ids = torch.tensor([t for r in rows for t in r])
    positions = torch.cat([torch.arange(n) for n in lens])
    meta = EncoderMetadata.of(lens, torch.device("cpu"))
    with torch.inference_mode():
        kernels = packed_kernel(torch.zeros(1, 3, 4, 32), meta) is not None
        assert kernels is (not avx512 and cpu_kernels.cpu_ops() is not None)  # g++ is a test dependency
        ours = engine.model(ids, positions, [], meta)
        padded = torch.zeros(len(rows), max(lens), dtype=torch.int64)
        mask = torch.zeros_like(padded)
        for b, r in enumerate(rows):
            padded[b, :len(r)], mask[b, :len(r)] = torch.tensor(r), 1
        theirs = hf(input_ids=padded, attention_mask=mask).last_hidden_state[mask.bool()]
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (sum(lens), 128)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)

    out = engine.embed(texts)  # no modules.json: mean pooling of every token, no normalization
    means = torch.stack([theirs[s:s + n].mean(0) for s, n in zip(np.cumsum([0, *lens[:-1]]), lens, strict=True)])
    np.testing.assert_allclose(np.stack([o.embedding for o in out]), means.numpy(), atol=1e-4, rtol=0)
    assert [o.num_prompt_tokens for o in out] == lens
    assert [o.truncated for o in out] == [len(r) > MAX_POSITIONS for r in engine.tokenizer.hf_tokenizer(texts)[
        "input_ids"]]


def test_one_batch_per_budget_gives_the_same_vectors(tiny_bert: tuple[Path, object], texts: list[str]) -> None:
    """The batch plan (rows per forward, token budget) changes no vector: rows never see each other."""
    folder, _ = tiny_bert
    wide = LLMEngine.from_model(str(folder), EngineConfig(device="cpu", dtype="float32"))
    narrow = wide.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=3,
                                           max_num_batched_tokens=128))
    a = np.stack([o.embedding for o in wide.embed(texts)])
    b = np.stack([o.embedding for o in narrow.embed(texts)])
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
