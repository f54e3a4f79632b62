"""bench/embed_gpu.py's embed presets checked without a GPU: the full bge-large-en-v1.5 and Qwen3-Embedding-0.6B
shapes build on the meta device from their released configs (no memory, no weights), and the same shapes cut to 2
layers of width 64 run the whole benchmark on the CPU over real texts (bench/gpu_session.sh's `embed` step's
arguments are checked by tests/bench/test_gpu_session.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.embed_gpu import EMBED_PRESETS, embed_preset, main, preset_embedder, tokenizer_folder
from engine import EngineConfig
from engine.model.registry import build_model, config_tasks


@pytest.mark.parametrize(("name", "shape", "params_m", "mode"), [
    ("bge-large-en-v1.5", dict(architecture="bert", num_layers=24, hidden_size=1024, num_heads=16, num_kv_heads=16,
                               intermediate_size=4096, vocab_size=30522, max_position_embeddings=512), 334.1, "cls"),
    ("qwen3-embedding-0.6b", dict(architecture="qwen3", num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8,
                                  head_dim=128, intermediate_size=3072, vocab_size=151669, qk_norm=True),
     595.8, "lasttoken")])
def test_the_full_shapes_build_on_the_meta_device(name: str, shape: dict, params_m: float, mode: str) -> None:
    """The released shapes, parameters counted on the meta device: BERT-large without its unused pooler; Qwen3's
    trunk (its tied embeddings counted once: no LM head kept, as sentence-transformers loads it)."""
    cfg, pooling = embed_preset(name)
    assert {k: getattr(cfg, k) for k in shape} == shape
    assert config_tasks(cfg) == ("embed", "score")  # an embed-only engine: no KV pool
    assert (pooling.modes, pooling.normalize) == ((mode,), True)
    with torch.device("meta"):
        model = build_model(cfg, pooling.max_seq_length)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(params_m, abs=0.1)
    assert all(p.is_meta for p in model.parameters())


def test_the_tiny_shapes_embed_real_texts_on_the_cpu(gsm8k_questions: list[str]) -> None:
    engine = preset_embedder("qwen3-embedding-0.6b", EngineConfig(device="cpu", dtype="float32"),
                             tokenizer_folder(None), tiny=True)
    assert (engine.model_config.num_layers, engine.model_config.num_kv_heads, engine.num_kv_blocks) == (2, 2, 0)
    out = engine.embed(gsm8k_questions[:6])
    vectors = np.stack([o.embedding for o in out])
    assert vectors.shape == (6, 64) and np.allclose(np.linalg.norm(vectors, axis=-1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="unknown embed preset 'bge-small'; known: bge-large-en-v1.5"):
        embed_preset("bge-small")


def test_the_benchmark_runs_both_presets_at_tiny_scale(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--device", "cpu", "--dtype", "float32", "--tiny", "--rows", "12", "--repeats", "1"])
    assert [r["preset"] for r in rows] == list(EMBED_PRESETS)
    for r in rows:
        assert r["rows"] == 12 and r["input_tokens"] > 12 and r["rows_per_s"] > 0 and r["dimension"] == 64
        # "seconds" is printed to 4 decimals: the bill must lie within what that rounding allows, at any speed
        per_dollar = [r["input_tokens"] / ((r["seconds"] + d) / 3600 * 3.0) for d in (5e-5, -5e-5)]
        assert per_dollar[0] - 1 <= r["input_tokens_per_dollar"] <= per_dollar[1] + 1
    assert "input tok/$" in capsys.readouterr().out
