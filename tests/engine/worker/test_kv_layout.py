"""The KV cache layout comes from the model (engine.core.kv_cache_spec): memory fit, the KV pool (engine.worker.device)
and the runner size a model whose layers mix sliding and full attention, and one with no KV cache (an encoder),
from its kv_cache_specs, never from ModelConfig's head counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import EngineConfig, SamplingParams
from engine.config import ModelConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_spec import NO_KV_CACHE, KVCacheSpec, full_attention, pool_blocks
from engine.core.request import Request
from engine.layers.rope import RotaryEmbedding
from engine.llm_engine import LLMEngine
from engine.loading.presets import random_model
from engine.model.base import ModelBase
from engine.model.registry import kv_cache_layout
from engine.worker import device as dev
from engine.worker.memory_fit import NO_KV_LIMIT, MemoryFit, kv_layout_bytes_per_token
from engine.worker.model_runner import ModelRunner

CPU = torch.device("cpu")
# Gemma-2-like: sliding and full layers interleaved.
MIXED = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=8, max_position_embeddings=128, sliding_window=8,
                    layer_types=("sliding_attention", "full_attention") * 2)
ENCODER = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=128)


class Encoder(ModelBase):
    """A stub model without a KV cache (an encoder's layers: every KVCacheSpec of kind "none"): hidden states are
    the token embeddings, logits the LM head's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config, self.max_positions = cfg, 16
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.layers = nn.ModuleList()
        self.rotary = RotaryEmbedding(cfg, 16)
        self.kv_cache_specs = (NO_KV_CACHE,) * cfg.num_layers

    def forward(self, input_ids: torch.Tensor | None, rope_rows: torch.Tensor, kv_caches: list, meta: object,
                attn_fn: object = None, *, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        assert len(kv_caches) == self.config.num_layers and all(k.numel() == v.numel() == 0 for k, v in kv_caches)
        return self.embed(input_ids) if inputs_embeds is None else inputs_embeds

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
        return self.lm_head(hidden).float()


def test_specs_refuse_what_does_not_fit_their_kind() -> None:
    assert full_attention(2, 8) == KVCacheSpec("full", 2, 8) and full_attention(2, 8, 4).kind == "sliding"
    for bad in (dict(kind="paged"), dict(kind="full", num_kv_heads=0, head_size=8),
                dict(kind="full", num_kv_heads=2, head_size=8, window=4), dict(kind="sliding", num_kv_heads=2,
                                                                               head_size=8),
                dict(kind="none", num_kv_heads=2)):
        with pytest.raises(ValueError, match="KVCacheSpec"):
            KVCacheSpec(**bad)


def test_a_mixed_layout_is_sized_layer_by_layer() -> None:
    """Every layer's K and V at its own heads and head size count, the sliding ones as the full ones (the pool's
    block ids are shared by every layer); a "none" layer counts nothing."""
    layout = (full_attention(2, 8, window=8), full_attention(4, 16), NO_KV_CACHE, full_attention(1, 8, window=8))
    per_token = 2 * (2 * 8 + 4 * 16 + 0 + 1 * 8) * 4
    assert kv_layout_bytes_per_token(layout, "float32") == per_token == 704
    assert dev.kv_block_bytes(layout, 16, torch.float32) == 16 * per_token
    assert pool_blocks(layout, 16, 4, budget_bytes=100 * 16 * per_token + 5, usable_blocks=1000) == 100
    assert pool_blocks(layout, 16, 4, budget_bytes=100 * 16 * per_token, usable_blocks=40) == 40
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        pool_blocks(layout, 16, 4, budget_bytes=16 * per_token - 1, usable_blocks=1000)
    config = EngineConfig(device="cpu", kv_cache_memory_bytes=10 * 16 * per_token, max_num_seqs=64)
    assert dev.num_kv_blocks(MIXED, config, CPU, torch.float32, layout) == 10
    fit = MemoryFit("cpu", 1 << 30, 1 << 20, per_token, 10 * 16 * per_token, max_model_len=32, block_size=16)
    assert (fit.pool_tokens, fit.sequences) == (160, 5)


def test_the_runner_allocates_the_models_mixed_layout() -> None:
    model = random_model(MIXED, torch.float32, CPU, max_positions=32)
    assert model.kv_cache_specs == kv_cache_layout(MIXED)
    assert [s.kind for s in model.kv_cache_specs] == ["sliding", "full"] * 2
    runner = ModelRunner(model, MIXED, 6, 16, CPU, torch.float32)
    assert [tuple(k.shape) for k, _ in runner.kv_caches] == [(6, 16, 2, 8)] * 4
    assert dev.kv_block_bytes(model.kv_cache_specs, 16, torch.float32) == 16 * 4 * 2 * 2 * 8 * 4


def test_a_model_without_a_kv_cache_takes_no_kv_memory_and_runs() -> None:
    """An encoder-like model: 0 KV bytes, a pool of block ids as large as the batch can use (no memory behind it),
    empty caches in the runner, and memory fit never refuses it for its KV cache."""
    model = Encoder(ENCODER).eval()
    assert kv_layout_bytes_per_token(model.kv_cache_specs, torch.float32) == 0
    config = EngineConfig(device="cpu", kv_cache_memory_bytes=1, max_num_seqs=4, max_model_len=64, block_size=16)
    blocks = dev.num_kv_blocks(ENCODER, config, CPU, torch.float32, model.kv_cache_specs)
    assert blocks == 4 * 64 // 16  # max_num_seqs sequences of max_model_len, though the budget is 1 byte
    manager = KVCacheManager(blocks, 16, enable_prefix_caching=False)
    for i in range(4):  # every sequence the batch may hold, each at max_model_len
        request = Request(f"r{i}", list(range(64)), SamplingParams(max_tokens=1))
        assert manager.allocate_slots(request, 64) is not None
    fit = MemoryFit("cpu", 1 << 30, 1 << 20, 0, (1 << 30) - (1 << 20), max_model_len=64, block_size=16)
    assert (fit.sequences, fit.pool_tokens, fit.refusal("encoder", None)) == (NO_KV_LIMIT, NO_KV_LIMIT, None)
    assert "no KV cache" in fit.line()
    engine = LLMEngine(model, ENCODER, None, config, "encoder stub", CPU, torch.float32)
    assert [tuple(k.shape) for k, _ in engine.runner.kv_caches] == [(0,)] * 2
    out = engine.generate([[3, 5, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    with torch.no_grad():  # each step's logits are the last token's embedding through the LM head
        first = int(model.compute_logits(model.embed(torch.tensor([7]))).argmax())
    assert out[0].output_token_ids[0] == first and len(out[0].output_token_ids) == 3
