"""Readers of the config fields of the families whose math goes beyond Llama's: Gemma 2, Gemma 3 text (soft-capping,
the extra norms, the embedding scale, per-layer sliding/global attention, Gemma 3's two RoPE bases), Phi-3's
partial rotary (Phi-4-mini) and gpt-oss (attention sinks, biases, clamped SwiGLU, alternating windows), from a
Hugging Face `config.json` dict or from GGUF metadata as llama.cpp's converter writes it. Each returns the
ModelConfig fields it sets (engine.model.hf_config and engine.loading.gguf_file merge
them); what it does not implement is a ValueError
naming the field.

Sources: HF transformers' Gemma2Config / Gemma3TextConfig / Phi3Config (defaults, `layer_types`, `rope_parameters`),
llama.cpp's convert_hf_to_gguf.py (Gemma2Model, Gemma3Model, Phi3MiniModel, GptOssModel) and llama-model.cpp (what a
GGUF leaves implicit: the attention scale, Gemma 3's local RoPE base and layer pattern, gpt-oss's layer pattern and
SwiGLU clamp).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

GELU_TANH = "gelu_pytorch_tanh"
#: The clamped SwiGLU of gpt-oss's experts (HF GptOssConfig's defaults; llama.cpp's constants for every gpt-oss GGUF,
#: which stores neither: llama-graph.cpp LLM_FFN_SWIGLU_OAI_MOE).
GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA = 7.0, 1.702
#: Gemma 3's defaults when config.json leaves them out (transformers' Gemma3TextConfig.default_theta, pattern 6).
GEMMA3_GLOBAL_THETA, GEMMA3_LOCAL_THETA, GEMMA3_PATTERN = 1_000_000.0, 10_000.0, 6


def _layer_types(config: dict[str, Any], pattern: int, offset: int = 1) -> tuple[str, ...]:
    """`layer_types` of config.json, else every `pattern`-th layer global and the others sliding (HF's default:
    layer i slides when (i + offset) % pattern != 0: Gemma's last layer of each period global (offset 1),
    ModernBERT's first (0))."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + offset) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json layer_types {types} is not {n} of full_attention / sliding_attention")
    return tuple(types)


def _gemma_common(config: dict[str, Any], types: tuple[str, ...]) -> dict[str, Any]:
    act = config.get("hidden_activation") or GELU_TANH
    if act != GELU_TANH:
        raise ValueError(f"config.json sets hidden_activation={act!r}, which tokenmill does not implement for "
                         f"{config['model_type']} (it runs {GELU_TANH})")
    if config.get("use_bidirectional_attention"):
        raise ValueError("config.json sets use_bidirectional_attention=true (an embedding model); tokenmill runs "
                         "causal decoders only")
    window = config.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise ValueError("config.json has sliding_attention layers but no sliding_window")
    return dict(hidden_act=GELU_TANH, norm_weight_offset=1.0, embedding_scale=math.sqrt(int(config["hidden_size"])),
                query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)), sandwich_norms=True,
                layer_types=types, sliding_window=int(window) if "sliding_attention" in types else None)


def gemma2_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 (HF Gemma2Config): alternating sliding/global layers, attention and final logit soft-capping
    (defaults 50 and 30 when config.json leaves them out). Raises ValueError."""
    out = _gemma_common(config, _layer_types(config, 2))
    out["attn_logit_softcapping"] = config.get("attn_logit_softcapping", 50.0)
    out["final_logit_softcapping"] = config.get("final_logit_softcapping", 30.0)
    return out


def gemma3_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 text (HF Gemma3TextConfig): 5 sliding layers to 1 global by default (`layer_types`, else
    `sliding_window_pattern`, or `_sliding_window_pattern` as transformers 5 writes it), the
    global layers' RoPE (rope_theta, default 1e6, and its scaling) and the sliding layers' base
    (`rope_local_base_freq`, default 1e4, unscaled); transformers 5 writes both as `rope_parameters` by layer type.
    Attention soft-capping, which HF's Gemma 3 does not apply, is refused. Raises ValueError."""
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError(f"config.json sets attn_logit_softcapping={config['attn_logit_softcapping']!r}, which "
                         "Gemma 3 does not use (HF transformers ignores it); remove it")
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or GEMMA3_PATTERN
    out = _gemma_common(config, _layer_types(config, int(pattern)))
    out["final_logit_softcapping"] = config.get("final_logit_softcapping")
    params = config.get("rope_parameters") or {}
    if "sliding_attention" in params or "full_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"config.json rope_parameters.sliding_attention is {local}; tokenmill runs the "
                             "sliding layers' RoPE unscaled (rope_type default)")
        out["rope_local_theta"] = float(local.get("rope_theta", GEMMA3_LOCAL_THETA))
    else:
        out["rope_local_theta"] = float(config.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
        if "rope_theta" not in config and "rope_theta" not in params:
            out["rope_theta"] = GEMMA3_GLOBAL_THETA
    return out


def gemma_gguf_fields(get: Callable[[str, Any], Any], *, layers: int, hidden: int, heads: int, head_dim: int,
                      gemma3: bool) -> dict[str, Any]:
    """The Gemma fields of a GGUF file's metadata (`get(key without the "{arch}." prefix, default)`), as llama.cpp
    reads them: soft-capping from `attn_logit_softcapping` / `final_logit_softcapping`; the window from
    `attention.sliding_window` on every 2nd (Gemma 2) or 6 in 6 (Gemma 3, llama.cpp's fixed pattern) layer, the
    last of each period global; Gemma 3's local RoPE base `rope.freq_base_swa` (default 1e4). The attention scale
    is not stored: llama.cpp takes hidden / heads for the 27B models (46 layers for Gemma 2, 62 for Gemma 3) and
    head_dim for the others, and so does this."""
    window = get("attention.sliding_window", None)
    pattern = 6 if gemma3 else 2
    types = tuple("sliding_attention" if window and (i + 1) % pattern else "full_attention" for i in range(layers))
    is_27b = layers == (62 if gemma3 else 46)
    out = dict(hidden_act=GELU_TANH, norm_weight_offset=1.0, embedding_scale=math.sqrt(hidden),
               query_pre_attn_scalar=float(hidden // heads if is_27b else head_dim), sandwich_norms=True,
               layer_types=types, sliding_window=int(window) if window else None,
               final_logit_softcapping=get("final_logit_softcapping", None))
    if gemma3:
        out["rope_local_theta"] = float(get("rope.freq_base_swa", GEMMA3_LOCAL_THETA))
        _warn_gemma3_gguf(layers, bool(window), out["query_pre_attn_scalar"])
    else:
        out["attn_logit_softcapping"] = get("attn_logit_softcapping", None)
    return out


@functools.cache
def _warn_gemma3_gguf(layers: int, window: bool, query_scale: float) -> None:
    """Warn, once per shape, that a Gemma 3 GGUF runs llama.cpp's layer pattern and query scale: the file cannot
    store the HF config's `sliding_window_pattern` / `layer_types` nor its `query_pre_attn_scalar` (as a Mistral
    GGUF cannot store its window: engine.loading.gguf_config)."""
    pattern = "5 sliding layers then 1 global" if window else "no sliding window"
    log.warning("a Gemma 3 GGUF cannot store its layer pattern nor its query scale: tokenmill takes llama.cpp's "
                "(%s, query_pre_attn_scalar %g, over %d layers); where the Hugging Face config differs the text "
                "differs from Hugging Face's; load the Hugging Face folder to keep them", pattern, query_scale, layers)


def gpt_oss_fields(config: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss (HF GptOssConfig, modeling_gpt_oss): attention sinks, biases on q/k/v/o (attention_bias, default
    true), on the router and on every expert projection, the experts' clamped SwiGLU (swiglu_limit 7.0,
    swiglu_alpha 1.702 by default) and sliding layers alternating with full ones (`layer_types`, by default every
    even layer sliding). Raises ValueError for attention_bias false or sliding layers without a window."""
    if config.get("attention_bias", True) is not True:
        raise ValueError(f"config.json sets attention_bias={config['attention_bias']!r}; tokenmill runs gpt_oss with "
                         "its q/k/v/o biases (true)")
    types = _layer_types(config, 2)
    window = config.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise ValueError("config.json has sliding_attention layers but no sliding_window")
    limit = float(config.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT))
    alpha = float(config.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA))
    if not limit > 0:
        raise ValueError(f"config.json sets swiglu_limit={limit}; tokenmill runs gpt_oss's clamp with a limit > 0")
    return dict(layer_types=types, sliding_window=int(window) if "sliding_attention" in types else None,
                attention_sinks=True, o_bias=True, expert_bias=True, swiglu_limit=limit, swiglu_alpha=alpha)


def gpt_oss_gguf_fields(get: Callable[[str, Any], Any], *, layers: int, hidden: int, heads: int,
                        head_dim: int) -> dict[str, Any]:
    """gpt-oss's fields of GGUF metadata as llama.cpp reads them (llama-model.cpp, LLM_ARCH_OPENAI_MOE): the window
    `attention.sliding_window` (required) on the layers `attention.sliding_window_pattern` (a period p, default 2)
    marks: layer i slides when i % p < p - 1 (p = 2: the even layers, as HF's default `layer_types`); sinks, biases
    and the clamped SwiGLU with llama.cpp's fixed limit 7.0 and alpha 1.702.

    Raises ValueError naming a key whose value tokenmill does not implement: no window, a per-layer pattern array,
    or a sliding layers' RoPE base (`rope.freq_base_swa`) other than the full layers'."""
    window = get("attention.sliding_window", None)
    if not window:
        raise ValueError("GGUF gpt-oss file lacks gpt-oss.attention.sliding_window (llama.cpp requires it); "
                         "convert the model again")
    period = get("attention.sliding_window_pattern", 2)
    if isinstance(period, bool) or not isinstance(period, int) or period < 0:
        raise ValueError(f"GGUF gpt-oss.attention.sliding_window_pattern={period!r} is not implemented; tokenmill "
                         "(as llama.cpp) reads one period for gpt-oss")
    base, swa_base = get("rope.freq_base", None), get("rope.freq_base_swa", None)
    if swa_base is not None and swa_base != base:
        raise ValueError(f"GGUF gpt-oss.rope.freq_base_swa={swa_base} differs from rope.freq_base={base}; tokenmill "
                         "runs gpt-oss with one RoPE base for every layer")
    types = tuple("sliding_attention" if period == 0 or i % period < period - 1 else "full_attention"
                  for i in range(layers))
    return dict(layer_types=types, sliding_window=int(window) if "sliding_attention" in types else None,
                attention_sinks=True, o_bias=True, expert_bias=True, swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
                swiglu_alpha=GPT_OSS_SWIGLU_ALPHA)


def phi3_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's partial rotary of a config.json dict (Phi-4-mini: partial_rotary_factor 0.75, at the top level or in
    transformers 5's rope_parameters): rotary_dim = int(head_dim * factor), as HF's Phi3RotaryEmbedding; {} when
    the factor is 1. Raises ValueError for a factor outside (0, 1]."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise ValueError(f"config.json partial_rotary_factor {factor!r} must be a number in (0, 1]")
    if factor == 1:
        return {}
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    return {"rotary_dim": int(head_dim * factor)}


def phi3_gguf_fields(get: Callable[[str, Any], Any], *, layers: int, hidden: int, heads: int,
                     head_dim: int) -> dict[str, Any]:
    """Phi-3's partial rotary of GGUF metadata: llama.cpp's converter writes the rotated dims as
    `rope.dimension_count` (int(factor * hidden) // heads) and no key_length, so head_dim is hidden / heads there;
    {} when it rotates every dim."""
    rot = get("rope.dimension_count", None)
    return {} if rot is None or int(rot) == head_dim else {"rotary_dim": int(rot)}


def bert_fields(config: dict[str, Any]) -> dict[str, Any]:
    """BERT's encoder fields of a config.json dict (HF BertConfig): LayerNorm epsilon (layer_norm_eps, default
    1e-12), token type rows (type_vocab_size, default 2), the exact GELU, every head a key/value head, no LM head.
    Raises ValueError for position embeddings other than "absolute" (relative_key ones are not implemented)."""
    kind = config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"config.json sets position_embedding_type={kind!r}, which tokenmill does not implement for "
                         "bert; it runs 'absolute' position embeddings")
    return dict(rms_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
                type_vocab_size=int(config.get("type_vocab_size", 2)), hidden_act="gelu",
                num_kv_heads=int(config["num_attention_heads"]), tie_word_embeddings=False)


def xlm_roberta_fields(config: dict[str, Any]) -> dict[str, Any]:
    """XLM-RoBERTa's encoder fields of a config.json dict (HF XLMRobertaConfig: multilingual-e5, bge-m3): BERT's
    (bert_fields; its type_vocab_size is 1), and positions that start past padding_idx = pad_token_id (default 1;
    ModelConfig.position_padding_idx). Raises ValueError as bert_fields."""
    return dict(bert_fields(config), position_padding_idx=int(config.get("pad_token_id", 1)))


#: ModernBERT's RoPE bases when config.json leaves them out (HF ModernBertConfig.default_theta) and its pattern
#: (global_attn_every_n_layers, default 3: layers 0, 3, 6, ... global).
MODERNBERT_GLOBAL_THETA, MODERNBERT_LOCAL_THETA, MODERNBERT_PATTERN = 160_000.0, 10_000.0, 3


def _modernbert_theta(config: dict[str, Any], kind: str, legacy: str, default: float) -> float:
    """The RoPE base of ModernBERT's `kind` layers: rope_parameters[kind].rope_theta (transformers 5), else the
    legacy top-level field, else `default`. Raises ValueError for a rope_type other than default."""
    params = dict((config.get("rope_parameters") or {}).get(kind) or {})
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"config.json rope_parameters.{kind} is {params}; tokenmill runs ModernBERT's RoPE unscaled "
                         "(rope_type default)")
    return float(params.get("rope_theta", config.get(legacy, default)))


def modernbert_fields(config: dict[str, Any]) -> dict[str, Any]:
    """ModernBERT's encoder fields of a config.json dict (HF ModernBertConfig; Warner et al., "Smarter, Better,
    Faster, Longer", 2024): the LayerNorm epsilon (norm_eps, default 1e-5), `layer_types` (else every
    `global_attn_every_n_layers`-th layer global, layer 0 first, the others sliding), the local layers' symmetric
    window as HF's sliding_window = local_attention // 2 tokens each side (default 128 // 2), the global and local
    RoPE bases (rope_parameters by layer type, else global_rope_theta / local_rope_theta; 160000 / 10000), the
    exact GELU of its GeGLU MLP, every head a key/value head, no LM head. Raises ValueError for a hidden size that
    the heads do not divide, a window under 2 tokens or bad layer types (naming the field)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if hidden % heads:
        raise ValueError(f"config.json hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    types = _layer_types(config, int(config.get("global_attn_every_n_layers") or MODERNBERT_PATTERN), offset=0)
    window = config.get("local_attention", 128)
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"config.json local_attention={window!r}: tokenmill runs a window of >= 2 tokens (an int)")
    return dict(rms_norm_eps=float(config.get("norm_eps", 1e-5)), hidden_act="gelu", num_kv_heads=heads,
                head_dim=hidden // heads, tie_word_embeddings=False, layer_types=types,
                sliding_window=window // 2 if "sliding_attention" in types else None,
                rope_theta=_modernbert_theta(config, "full_attention", "global_rope_theta", MODERNBERT_GLOBAL_THETA),
                rope_local_theta=_modernbert_theta(config, "sliding_attention", "local_rope_theta",
                                                   MODERNBERT_LOCAL_THETA))
