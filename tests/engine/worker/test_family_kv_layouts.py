"""The KV cache layout of the real family files, read from their HF configs through the registry (issue 52's target):
Gemma 2 and Gemma 3, whose layers mix sliding and full attention, and BERT, an encoder that keeps no KV cache. The
model's kv_cache_specs size the KV pool (engine.worker.device), the runner's caches, the KV cache manager's blocks,
memory fit (engine.worker.memory_fit) and the client's fit check (jobs.plan.preflight.model_context); the stub models
of tests/engine/worker/test_kv_layout.py check the same seams one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_models import WINDOW, hf_config

from engine import EngineConfig, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_spec import NO_KV_CACHE
from engine.core.request import Request
from engine.loading.presets import random_model
from engine.model.hf_config import config_from_hf
from engine.model.registry import kv_cache_layout
from engine.worker import device as dev
from engine.worker.memory_fit import NO_KV_LIMIT, MemoryFit, kv_layout_bytes_per_token
from engine.worker.model_runner import ModelRunner

CPU = torch.device("cpu")
BLOCK = 16
#: The layers' kinds in each tiny config (tests/engine/family_models.py): Gemma 2 alternates, Gemma 3 has five
#: sliding layers per full one.
KINDS = {"gemma2": ["sliding", "full"], "gemma3_text": ["sliding"] * 5 + ["full"]}


def _bert_config() -> dict:
    import transformers

    return transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, max_position_embeddings=64).to_dict()


@pytest.mark.parametrize("family", sorted(KINDS))
def test_a_gemma_mixes_sliding_and_full_layers_and_every_one_takes_pool_memory(family: str) -> None:
    """Every layer keeps every token (the pool's block ids are shared; a sliding layer's attention reads its
    window), so a block costs all layers' K and V; 7 blocks' worth of budget is a 7-block pool, the runner's caches
    are those bytes exactly, and the manager hands out 7 x 16 token slots, then refuses."""
    cfg = config_from_hf(hf_config(family, 96).to_dict())
    model = random_model(cfg, torch.float32, CPU, max_positions=128)
    specs = model.kv_cache_specs
    assert specs == kv_cache_layout(cfg) and [s.kind for s in specs] == KINDS[family]
    assert {s.window for s in specs if s.kind == "sliding"} == {WINDOW}
    assert {(s.num_kv_heads, s.head_size) for s in specs} == {(2, 16)}
    per_token = kv_layout_bytes_per_token(specs, torch.float32)
    assert per_token == len(specs) * 2 * 2 * 16 * 4
    config = EngineConfig(device="cpu", kv_cache_memory_bytes=7 * BLOCK * per_token + 5, max_num_seqs=64)
    blocks = dev.num_kv_blocks(cfg, config, CPU, torch.float32, specs)
    assert blocks == 7
    runner = ModelRunner(model, cfg, blocks, BLOCK, CPU, torch.float32)
    assert sum(k.numel() + v.numel() for k, v in runner.kv_caches) * 4 == blocks * BLOCK * per_token
    manager = KVCacheManager(blocks, BLOCK, enable_prefix_caching=False)
    first = Request("a", list(range(3, 103)), SamplingParams(max_tokens=1))  # 100 tokens: 7 blocks
    assert manager.allocate_slots(first, 100) is not None and manager.num_free_blocks == 0
    assert manager.allocate_slots(Request("b", [5, 6], SamplingParams(max_tokens=1)), 2) is None
    fit = MemoryFit("cpu", 1 << 30, 1 << 20, per_token, blocks * BLOCK * per_token, max_model_len=56,
                    block_size=BLOCK)
    assert (fit.pool_tokens, fit.sequences) == (7 * BLOCK, 1)  # 56 tokens round up to 4 blocks: one fits


def test_bert_keeps_no_kv_cache_and_takes_no_pool_memory() -> None:
    """BERT's layers keep nothing: 0 bytes per token, a pool of block ids as large as the batch can use whatever
    the budget, empty runner caches, and memory fit bounds nothing by its KV cache."""
    cfg = config_from_hf(_bert_config())
    model = random_model(cfg, torch.float32, CPU, max_positions=64)
    assert model.kv_cache_specs == kv_cache_layout(cfg) == (NO_KV_CACHE,) * 2
    assert kv_layout_bytes_per_token(model.kv_cache_specs, torch.float32) == 0
    config = EngineConfig(device="cpu", kv_cache_memory_bytes=1, max_num_seqs=4, max_model_len=64)
    assert dev.num_kv_blocks(cfg, config, CPU, torch.float32, model.kv_cache_specs) == 4 * 64 // BLOCK
    fit = MemoryFit("cpu", 1 << 30, 1 << 20, 0, (1 << 30) - (1 << 20), max_model_len=64, block_size=BLOCK)
    assert (fit.pool_tokens, fit.sequences, fit.refusal("bert", None)) == (NO_KV_LIMIT, NO_KV_LIMIT, None)


def test_the_clients_fit_check_reads_the_layout(tmp_path: Path) -> None:
    """The CLI's preflight (no torch there) counts the layers that keep a cache: every Gemma layer, no BERT layer,
    whose fit check then has nothing to refuse."""
    from jobs.plan.model_fit import check_fit
    from jobs.plan.preflight import model_context

    for name, config in (("gemma2", hf_config("gemma2", 96).to_dict()), ("bert", _bert_config())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    gemma = model_context(str(tmp_path / "gemma2"))
    assert (gemma["layers"], gemma["kv_heads"], gemma["head_dim"]) == (2, 2, 16)
    bert = model_context(str(tmp_path / "bert"))
    assert bert["layers"] == 0
    assert check_fit(str(tmp_path / "bert"), EngineConfig(device="cpu"), bert) is None
