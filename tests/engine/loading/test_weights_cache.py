"""The weights cache (engine/loading/weights_cache.py: read_gguf_state): a GGUF is read and dequantized once per
dtype, later loads read the cached safetensors file, and the cached model is the same model (same config,
bit-identical tensors, same greedy tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loading import gguf_file
from engine.loading.open_model import open_model
from engine.loading.weights_cache import weights_cache_dir

CPU = torch.device("cpu")


def test_a_cached_load_is_the_same_model_and_skips_the_gguf(gguf_path: str, gsm8k_questions: list[str],
                                                            real_engine: LLMEngine, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    folder = weights_cache_dir(gguf_path, torch.float32)
    assert not folder.exists()
    cfg, built, *_ = open_model(gguf_path, torch.float32, CPU, tokenizer=False)
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert weights_cache_dir(gguf_path, torch.bfloat16) != folder  # one entry per dtype

    import gguf

    def no_gguf(*_a: object, **_k: object) -> None:
        raise AssertionError("a cached load must not read the GGUF file")

    from engine.loading import weights_cache

    monkeypatch.setattr(gguf, "GGUFReader", no_gguf)
    monkeypatch.setattr(gguf_file, "open_gguf", no_gguf)  # the engine's one way to open a GGUF file
    # The plain load of the loading entry point (quantization "none", as `tokenmill perplexity`; the INT8 load's state
    # reads it too, engine.loading.quantized) reads the fp32 entry: no GGUF tensor is dequantized again.
    monkeypatch.setattr(weights_cache, "iter_gguf_state", no_gguf)
    cached_cfg, cached, *_ = open_model(gguf_path, torch.float32, CPU, quantization="none", tokenizer=False)
    assert cached_cfg == cfg
    a, b = built.state_dict(), cached.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cached.lm_head.weight is cached.embed_tokens.weight  # still tied
    # The whole engine on the cached weights: the greedy tokens on real prompts of the session's engine on the
    # default model (conftest's real_engine, loaded through the session's own cache).
    monkeypatch.undo()
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    params = SamplingParams(max_tokens=8)
    again = LLMEngine.from_model(gguf_path, EngineConfig(device="cpu", dtype="float32"))  # from the entry above
    real_engine.reset_prefix_cache()
    reference = real_engine.generate(gsm8k_questions[:3], params)
    assert [o.output_token_ids for o in again.generate(gsm8k_questions[:3], params)] == [
        o.output_token_ids for o in reference]


def test_a_broken_entry_is_rebuilt_and_the_cache_can_be_turned_off(gguf_path: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENMILL_WEIGHTS_CACHE", "0")
    open_model(gguf_path, torch.bfloat16, CPU, tokenizer=False)
    assert not (tmp_path / "cache" / "weights").exists()
    monkeypatch.delenv("TOKENMILL_WEIGHTS_CACHE")
    cfg, model, *_ = open_model(gguf_path, torch.bfloat16, CPU, tokenizer=False)
    folder = weights_cache_dir(gguf_path, torch.bfloat16)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")  # damaged (a disk error, a killed copy)
    cfg2, model2, *_ = open_model(gguf_path, torch.bfloat16, CPU, tokenizer=False)
    assert cfg2 == cfg and torch.equal(model2.embed_tokens.weight, model.embed_tokens.weight)
    assert (folder / "model.safetensors").stat().st_size > 1 << 20  # rebuilt on the next load
    model3 = open_model(gguf_path, torch.bfloat16, CPU, tokenizer=False).model
    assert torch.equal(model3.layers[3].mlp.down_proj.weight, model.layers[3].mlp.down_proj.weight)


def test_open_gguf_reads_what_gguf_reader_reads(gguf_path: str) -> None:
    """engine.loading.gguf_file.open_gguf (the faster metadata parse every uncached GGUF load takes) holds the same
    fields,
    values and tensors as gguf.GGUFReader on the real model file."""
    import gguf
    import numpy as np

    slow, fast = gguf.GGUFReader(gguf_path), gguf_file.open_gguf(gguf_path)
    assert isinstance(fast, gguf.GGUFReader) and fast.fields.keys() == slow.fields.keys()
    assert len(slow.fields["tokenizer.ggml.tokens"].data) > 40_000  # the vocabulary: most of the parse
    for key, a in slow.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.types, a.data) == (b.offset, b.types, b.data), key
        assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a.parts, b.parts, strict=True)), key
        assert a.contents() == b.contents(), key
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in fast.tensors] == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset) for t in slow.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(slow.tensors, fast.tensors, strict=True))


def test_open_gguf_names_a_file_cut_inside_its_vocabulary(gguf_path: str, tmp_path: Path) -> None:
    """The real model file cut inside its tokenizer's strings (read in one loop per array): one line naming the file,
    where it ends, and the fix."""
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        cut.write_bytes(f.read(300_000))
    with pytest.raises(ValueError, match=f"{cut} is not a complete GGUF file: it ends at byte 300,000 and its "
                                         r"contents run to byte 300,\d{3} at least; download or convert") as e:
        gguf_file.open_gguf(str(cut))
    assert "\n" not in str(e.value)


def test_the_cache_stays_under_its_limit_least_recently_used_out(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries of 4 MB under a 10 MB limit (TOKENMILL_WEIGHTS_CACHE_GB): the third write removes the entry least
    recently read, not the oldest written; an entry over the limit is not written and removes nothing; stale
    temporary folders of crashed writers go; a bad limit is one line naming the variable."""
    import os
    import time

    from engine.loading.presets import preset_config
    from engine.loading.weights_cache import read_weights_cache, weights_cache_enabled, write_weights_cache

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENMILL_WEIGHTS_CACHE_GB", "0.010")
    cfg, root = preset_config("tiny-smollm2"), tmp_path / "cache" / "weights"
    state = {"w": torch.randn(1000, 1000)}  # 4 MB of fp32
    a, b, c = root / "a", root / "b", root / "c"
    write_weights_cache(a, cfg, state)
    write_weights_cache(b, cfg, state)
    past = time.time() - 100
    os.utime(a, (past, past))
    os.utime(b, (past + 10, past + 10))  # b written after a ...
    stale = root / ".tmp-crashed"
    stale.mkdir()
    os.utime(stale, (past - 7200, past - 7200))
    got = read_weights_cache(a)  # ... but a read since
    assert got is not None and got[0] == cfg and torch.equal(got[1]["w"], state["w"])
    write_weights_cache(c, cfg, state)
    assert sorted(p.name for p in root.iterdir()) == ["a", "c"]  # b, the least recently used, and the stale folder
    write_weights_cache(root / "big", cfg, {"w": torch.randn(3000, 1000)})  # 12 MB: over the limit
    assert sorted(p.name for p in root.iterdir()) == ["a", "c"]
    assert read_weights_cache(root / "big") is None
    monkeypatch.setenv("TOKENMILL_WEIGHTS_CACHE_GB", "lots")
    with pytest.raises(ValueError, match="TOKENMILL_WEIGHTS_CACHE_GB must be a size in GB, got 'lots'"):
        weights_cache_enabled()  # the loaders' first call, before any work
