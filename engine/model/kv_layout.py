"""The KV cache layout of the causal decoder (engine.model.decoder, and the family files built on it) from its config
alone, no torch: what each Attention layer declares (`layer_kv_spec`) and what memory fit reads before any model is
built (`decoder_kv_layout`, through engine.model.registry.kv_cache_layout)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.core.kv_cache_spec import KVCacheSpec, full_attention


def layer_kv_spec(cfg: ModelConfig, layer: int) -> KVCacheSpec:
    """Layer `layer`'s cache: cfg.num_kv_heads heads of cfg.head_dim, sliding where cfg.layer_window(layer) is set
    (Mistral's every layer, Gemma's and gpt-oss's "sliding_attention" layers), else full."""
    return full_attention(cfg.num_kv_heads, cfg.head_dim, cfg.layer_window(layer))


def decoder_kv_layout(cfg: ModelConfig) -> tuple[KVCacheSpec, ...]:
    """One KVCacheSpec per layer of the causal decoder of shape `cfg`."""
    return tuple(layer_kv_spec(cfg, i) for i in range(cfg.num_layers))
