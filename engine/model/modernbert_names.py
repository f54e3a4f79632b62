"""ModernBERT's parameter names and shapes from the config alone, no torch: what the registry's entry for
"modernbert" declares (memory fit and the HF folder's name check read them before any model is built;
tests/engine/model/test_registry.py holds them equal to the built engine.model.modernbert model's). Its KV cache
layout is BERT's (engine.model.bert_names.bert_kv_layout: none in every layer).

Names are HF transformers' ModernBertModel state_dict keys (modeling_modernbert.py; a *ForSequenceClassification
folder's "model." prefix is dropped on load): no biases, and no attention norm in layer 0 (HF's nn.Identity there).
"""

from __future__ import annotations

from engine.config import ModelConfig


def modernbert_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter of the ModernBERT encoder of shape `cfg` (engine.model.modernbert)."""
    h, width, inner = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embeddings.tok_embeddings.weight": (cfg.vocab_size, h),
                                          "embeddings.norm.weight": (h,), "final_norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        if i:
            shapes[f"{p}.attn_norm.weight"] = (h,)
        shapes.update({f"{p}.attn.Wqkv.weight": (3 * width, h), f"{p}.attn.Wo.weight": (h, width),
                       f"{p}.mlp_norm.weight": (h,), f"{p}.mlp.Wi.weight": (2 * inner, h),
                       f"{p}.mlp.Wo.weight": (h, inner)})
    return shapes
