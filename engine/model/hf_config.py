"""A Hugging Face `config.json` (and `generation_config.json`) as a ModelConfig, through the family's registry entry
(engine.model.architectures): the common fields, RoPE scaling (`rope_scaling` or transformers 5's `rope_parameters`),
the mixture-of-experts fields, and the family's own readers. A field that changes the math and that the engine does
not implement is a ValueError naming it; a field nobody reads is a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.config import ModelConfig, RopeScaling
from engine.model.architectures import Architecture, get_architecture, supported
from engine.model.classifier_names import classifier_fields

#: config.json fields that describe training, serialization or the HF runtime, not the math of inference.
_IGNORED_FIELDS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id", "pretraining_tp",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class", "quantization_config", "max_window_layers",
    "use_sliding_window", "sliding_window", "layer_types", "rope_scaling", "rope_parameters", "rope_theta",
    "head_dim", "tie_word_embeddings", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "hidden_act",
    "attention_bias", "mlp_bias", "bos_token", "eos_token", "unsloth_fixed", "use_mrope",
    # read by the families' `fields` readers (engine.model.family_fields) or dropout / cache settings of training
    # and of HF's runtime
    "hidden_activation", "sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq",
    "use_bidirectional_attention", "cache_implementation", "original_max_position_embeddings", "resid_pdrop",
    "embd_pdrop", "final_logit_softcapping", "attn_logit_softcapping", "query_pre_attn_scalar", "partial_rotary_factor",
    # gpt-oss: read by gpt_oss_fields; OpenAI's own names of num_experts_per_tok and the original context (unread by
    # HF transformers too)
    "swiglu_limit", "swiglu_alpha", "experts_per_token", "initial_context_length",
    # BERT: read by bert_fields, or dropout / training settings
    "layer_norm_eps", "type_vocab_size", "position_embedding_type", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "classifier_dropout", "gradient_checkpointing", "is_decoder",
    "add_cross_attention",
    # ModernBERT: read by modernbert_fields (or refused by its entry), its MLM head's and training settings
    "norm_eps", "norm_bias", "local_attention", "global_attn_every_n_layers", "global_rope_theta", "local_rope_theta",
    "embedding_dropout", "mlp_dropout", "initializer_cutoff_factor", "decoder_bias", "deterministic_flash_attn",
    "sparse_prediction", "sparse_pred_ignore_index", "reference_compile", "repad_logits_with_grad",
    "classifier_pooling", "classifier_activation", "classifier_bias",
})
#: Fields of other families that change the math: set to anything but off/1 they are an error, not ignored.
_MATH_FIELDS = ("num_experts", "num_local_experts", "moe_intermediate_size", "use_mrope", "rope_interleaved",
                "attn_logit_softcapping", "final_logit_softcapping", "logits_scaling", "embedding_multiplier",
                "residual_multiplier", "attention_multiplier", "query_pre_attn_scalar", "logit_scale",
                "use_qk_norm", "no_rope_layers", "qk_layernorm", "use_parallel_residual", "partial_rotary_factor")

#: config.json fields of the mixture-of-experts families that `moe_from_hf` reads (or checks are trivial), and those
#: that only matter in training.
_MOE_FIELDS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "norm_topk_prob", "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
                         "qkv_bias", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise"})

log = logging.getLogger(__name__)


_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
              "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
              "truncate", "partial_rotary_factor", "short_factor", "long_factor"}


#: The RoPE types of a family whose entry names none (longrope only where a family's own model uses it).
_COMMON_ROPE = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_from_hf(config: dict[str, Any], rope_types: tuple[str, ...] = _COMMON_ROPE, partial_rotary: bool = False
                 ) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None) of a config.json dict: the old layout (`rope_theta` + `rope_scaling`) or
    transformers 5's `rope_parameters` (by layer type, as Gemma 3's: the full-attention layers' entry). Defaults as
    transformers' standardize_rope_params (original context = max_position_embeddings for llama3/yarn; yarn's and
    longrope's factor = max / original when missing; Phi-3's "su" is longrope).

    Raises ValueError for a rope type not in `rope_types` or an unknown key, or a partial rotary factor other
    than 1 unless `partial_rotary` (the family reads it: engine.model.family_fields.phi3_fields)."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:  # by layer type; the local one: family_fields
        params = dict(params.get("full_attention") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise ValueError(f"rope_scaling has fields {unknown} tokenmill does not implement")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and not partial_rotary:
        raise ValueError(f"partial_rotary_factor {partial} is not implemented for {config.get('model_type')} "
                         "(only full-width RoPE)")
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind not in rope_types:
        raise ValueError(f"rope_scaling type {kind!r} is not implemented for {config.get('model_type')}; tokenmill "
                         f"runs {', '.join(rope_types)} there")
    if kind == "default":
        return theta, None
    max_pos = int(config.get("max_position_embeddings", 2048))
    original = params.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    if kind == "dynamic" or original is None:  # dynamic: transformers scales by the ratio to max_position_embeddings
        original = max_pos
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / int(original) if kind in ("yarn", "longrope") else 1.0
    return theta, RopeScaling(
        rope_type=kind, factor=float(factor), original_max_position_embeddings=int(original),
        low_freq_factor=params.get("low_freq_factor"), high_freq_factor=params.get("high_freq_factor"),
        beta_fast=params.get("beta_fast"), beta_slow=params.get("beta_slow"), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)), short_factor=params.get("short_factor"),
        long_factor=params.get("long_factor"))


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list | tuple) else (int(value),)


def config_from_hf(config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """ModelConfig of a Hugging Face `config.json` dict (and `generation_config.json`'s, whose `eos_token_id` list
    adds stop tokens).

    Raises ValueError for an architecture we do not run (listing those we do), a field that changes the math and
    that we do not implement (naming it), or an inconsistent shape."""
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError(f"config.json has no model_type; tokenmill runs {supported()}")
    if model_type == "gemma3":  # Gemma 3's vision-language checkpoint: the gemma3_text reader, then the tower
        from engine.model.gemma3_vl_config import gemma3_vl_from_hf

        return gemma3_vl_from_hf(config, generation_config, config_from_hf)
    if model_type in ("llava", "llava_next"):  # vision-language: its text_config through this reader, then its tower
        from engine.model.llava_config import llava_from_hf

        return llava_from_hf(config, generation_config, config_from_hf)
    if model_type in ("idefics3", "smolvlm"):  # the same: a SigLIP encoder and a connector before a Llama
        from engine.model.idefics3_config import idefics3_from_hf

        return idefics3_from_hf(config, generation_config, config_from_hf)
    if model_type in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl"):  # Qwen's VLMs: the Qwen2 / Qwen3 reader, then the tower
        from engine.model.qwen_vl_config import qwen_vl_from_hf

        return qwen_vl_from_hf(config, generation_config, config_from_hf)
    arch = get_architecture(str(model_type))
    if model_type not in arch.hf_model_types:
        raise ValueError(f"config.json model_type {model_type!r} is not supported; tokenmill runs {supported()}")
    for field, allowed in arch.refused:
        if field in config and config[field] not in allowed:
            raise ValueError(f"config.json sets {field}={config[field]!r}, which tokenmill does not implement for "
                             f"{model_type} (it runs {field} in {list(allowed)})")
    read = _MOE_FIELDS if arch.router is not None else frozenset()
    changes_math = sorted(k for k in _MATH_FIELDS
                          if k not in arch.reads and k not in read
                          and config.get(k) not in (None, False, 0, 1, 1.0, [], {}))
    if changes_math:
        raise ValueError(f"config.json sets {changes_math} (= {[config[k] for k in changes_math]}), which tokenmill "
                         f"does not implement for {model_type}")
    moe = moe_from_hf(config, arch)
    unknown = sorted(k for k in config if k not in _IGNORED_FIELDS and k not in read and not k.endswith("_token_id"))
    if unknown:
        log.warning("config.json fields %s are not read by tokenmill (%s); check they do not change the output",
                    unknown, model_type)
    theta, scaling = rope_from_hf(config, arch.rope_types or _COMMON_ROPE, "partial_rotary_factor" in arch.reads)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    eos = _ids(config.get("eos_token_id"))
    stop = eos + tuple(i for i in _ids((generation_config or {}).get("eos_token_id")) if i not in eos)
    bos = config.get("bos_token_id")
    fields = dict(
        vocab_size=int(config["vocab_size"]), hidden_size=hidden, intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads), rope_theta=theta,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=int(bos) if isinstance(bos, int) else None, eos_token_id=stop[0] if stop else None,
        architecture=str(model_type), qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm, rope_scaling=scaling,
        eos_token_ids=stop, sliding_window=arch.window(config), **moe)
    if arch.fields is not None:
        fields.update(arch.fields(config))
    fields.update(classifier_fields(config, arch.name))  # a *ForSequenceClassification's labels
    return ModelConfig(**fields)


def moe_from_hf(config: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig (num_experts, num_experts_per_tok, moe_intermediate_size, router,
    norm_topk_prob, shared_expert_intermediate_size) of a config.json dict; {} for a dense family.

    Raises ValueError naming a field whose value tokenmill does not implement: dense MLP layers among the sparse
    ones (`decoder_sparse_step` other than 1, a non-empty `mlp_only_layers`), or a missing expert count."""
    if arch.router is None:
        return {}
    model_type = config.get("model_type")
    experts = config.get("num_experts", config.get("num_local_experts"))
    if not experts or not config.get("num_experts_per_tok"):
        raise ValueError(f"config.json of {model_type} lacks num_experts / num_experts_per_tok")
    step = config.get("decoder_sparse_step", 1)
    if step not in (1, None):
        raise ValueError(f"config.json sets decoder_sparse_step={step!r} (dense MLP layers between the sparse ones), "
                         f"which tokenmill does not implement for {model_type}; it runs every layer sparse (1)")
    if config.get("mlp_only_layers"):
        raise ValueError(f"config.json sets mlp_only_layers={config['mlp_only_layers']!r} (dense MLP layers), which "
                         f"tokenmill does not implement for {model_type}; it runs every layer sparse ([])")
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if arch.shared_expert and shared < 1:
        raise ValueError(f"config.json of {model_type} lacks shared_expert_intermediate_size")
    if not arch.shared_expert and shared:
        raise ValueError(f"config.json sets shared_expert_intermediate_size={shared}, which tokenmill does not "
                         f"implement for {model_type}")
    return dict(num_experts=int(experts), num_experts_per_tok=int(config["num_experts_per_tok"]),
                moe_intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
                router=arch.router, shared_expert_intermediate_size=shared,
                norm_topk_prob=arch.router == "softmax_topk" and bool(config.get("norm_topk_prob", False)))


