"""A LLaVA `config.json` (HF LlavaConfig: model_type "llava"; LlavaNextConfig: "llava_next", which adds the anyres
image_grid_pinpoints) as a ModelConfig: the language model's fields from the
nested `text_config` through its own family's reader (engine.model.hf_config), the vision tower's and the
projector's as a VisionConfig (engine.vision_config). Sources: Liu et al., "Visual Instruction Tuning" (2023) and
"Improved Baselines with Visual Instruction Tuning" (LLaVA-1.5, 2023); HF transformers' LlavaConfig and LlavaModel.

The nested configs are completed with their HF config class's defaults (as LlavaConfig itself does: the original
llava-1.5 checkpoints spell out only the fields that differ from LlamaConfig's and CLIPVisionConfig's), so this reader
imports transformers (lazily: it is the one reader that does).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from engine.config import ModelConfig
from engine.vision_config import VisionConfig

log = logging.getLogger(__name__)

#: The language models a LLaVA checkpoint may carry: the families of the generic causal decoder that the llava model
#: extends (engine.model.llava); a mixture-of-experts, Gemma or fused-projection text model is refused.
TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
VISION_MODEL_TYPES = ("clip_vision_model",)
#: Top-level LlavaConfig fields read here or that do not change inference.
_LLAVA_FIELDS = frozenset({
    "model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "text_config",
    "vision_config", "image_token_index", "image_token_id", "vision_feature_layer", "vision_feature_select_strategy",
    "projector_hidden_act", "multimodal_projector_bias", "image_seq_length", "tie_word_embeddings", "pad_token_id",
    "ignore_index", "vocab_size", "use_cache", "initializer_range", "bos_token_id", "eos_token_id",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "image_grid_pinpoints"})
#: LlavaNextConfig's image_grid_pinpoints when config.json has none.
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
#: Fields of the nested configs' to_dict() that are HF runtime settings, dropped unless the checkpoint set them.
_RUNTIME = ("architectures", "_name_or_path", "transformers_version", "dtype", "id2label", "label2id", "problem_type",
            "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
            "is_encoder_decoder")
_VISION_READ = frozenset({"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "image_size", "patch_size", "num_channels", "layer_norm_eps", "hidden_act", "projection_dim",
                          "attention_dropout", "dropout", "initializer_range", "initializer_factor",
                          "vocab_size"})  # llava-hf's configs carry CLIP's text vocab_size there; no vision weight


def completed(sub: dict[str, Any], default_type: str, allowed: tuple[str, ...], what: str,
              family: str = "llava") -> dict[str, Any]:
    """A nested config dict with its HF config class's defaults filled in (runtime fields dropped unless set).
    Raises ValueError for a model_type outside `allowed` (naming `family`, the reader asking)."""
    from transformers import CONFIG_MAPPING

    model_type = sub.get("model_type", default_type)
    if model_type not in allowed:
        raise ValueError(f"config.json {what}.model_type {model_type!r} is not run by tokenmill's {family}; it runs "
                         f"{list(allowed)}")
    full = CONFIG_MAPPING[model_type](**{k: v for k, v in sub.items() if k != "model_type"}).to_dict()
    return {k: v for k, v in full.items() if k not in _RUNTIME or k in sub} | {"model_type": model_type}


def text_model_config(config: dict[str, Any], generation_config: dict[str, Any] | None,
                      text_reader: Callable[[dict[str, Any], dict[str, Any] | None], ModelConfig],
                      family: str = "llava", defaults: dict[str, Any] | None = None,
                      text_types: tuple[str, ...] = TEXT_MODEL_TYPES) -> ModelConfig:
    """The language model's ModelConfig of a vision-language config.json dict: its `text_config` (over `defaults`,
    the fields its HF config class sets when absent; model_type text_types[0] when unset) completed and read by
    `text_reader` (engine.model.hf_config.config_from_hf). Raises ValueError for a text model outside `text_types`,
    or a tied embedding the nested and top-level configs disagree on."""
    text = completed((defaults or {}) | dict(config.get("text_config") or {}), text_types[0], text_types,
                     "text_config", family)
    cfg: ModelConfig = text_reader(text, generation_config)
    tie = config.get("tie_word_embeddings")
    if tie is not None and bool(tie) != cfg.tie_word_embeddings:
        raise ValueError(f"config.json sets tie_word_embeddings={tie} but text_config has "
                         f"{cfg.tie_word_embeddings}; tokenmill cannot tell which the checkpoint means")
    return cfg


def vision_from_hf(config: dict[str, Any]) -> VisionConfig:
    """The VisionConfig of a LLaVA config.json dict (its `vision_config` plus the top-level feature-layer, select
    strategy, projector and image-token fields). Raises ValueError naming a field tokenmill does not implement: a
    vision tower other than CLIP's, a list of feature layers, an unknown activation or strategy, no image token."""
    vision = completed(dict(config.get("vision_config") or {}), "clip_vision_model", VISION_MODEL_TYPES,
                        "vision_config")
    unread = sorted(set(vision) - _VISION_READ)
    if unread:
        log.warning("config.json vision_config fields %s are not read by tokenmill (llava); check they do not change "
                    "the output", unread)
    layer = config.get("vision_feature_layer", -2)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"config.json sets vision_feature_layer={layer!r}; tokenmill's llava runs one feature layer "
                         "(an int), not a list")
    token = config.get("image_token_id", config.get("image_token_index"))
    if token is None:
        raise ValueError("config.json of llava has no image_token_index / image_token_id: the image placeholder")
    return VisionConfig(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]), image_token_id=int(token),
        num_channels=int(vision.get("num_channels", 3)), layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
        hidden_act=str(vision.get("hidden_act", "quick_gelu")), feature_layer=layer,
        select_strategy=str(config.get("vision_feature_select_strategy", "default")),
        projector_hidden_act=str(config.get("projector_hidden_act", "gelu")),
        projector_bias=bool(config.get("multimodal_projector_bias", True)), image_grid_pinpoints=_pinpoints(config))


def _pinpoints(config: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """A LLaVA-NeXT config's image_grid_pinpoints (LlavaNextConfig's default when unset); () for LLaVA. Raises
    ValueError for LLaVA-NeXT's "full" select strategy (HF's pack_image_features assumes the CLS row dropped) or
    malformed pinpoints."""
    if config.get("model_type") != "llava_next":
        return ()
    if config.get("vision_feature_select_strategy", "default") != "default":
        raise ValueError("config.json sets vision_feature_select_strategy "
                         f"{config['vision_feature_select_strategy']!r}; tokenmill's llava_next runs 'default' only")
    points = config.get("image_grid_pinpoints") or DEFAULT_PINPOINTS
    if not all(isinstance(p, list | tuple) and len(p) == 2 for p in points):
        raise ValueError(f"config.json image_grid_pinpoints {points!r} is not a list of [height, width] pairs")
    return tuple((int(h), int(w)) for h, w in points)


def llava_from_hf(config: dict[str, Any], generation_config: dict[str, Any] | None,
                  text_reader: Callable[[dict[str, Any], dict[str, Any] | None], ModelConfig]) -> ModelConfig:
    """ModelConfig of a LLaVA config.json dict: `text_reader(text_config dict, generation_config)` (engine.model.
    hf_config.config_from_hf) gives the language model's fields, architecture "llava" and `vision` are set.
    Raises ValueError naming a field tokenmill does not implement (a text model outside TEXT_MODEL_TYPES, a tied
    embedding the nested and top-level configs disagree on, vision_from_hf's), or an image token outside the
    vocabulary."""
    unknown = sorted(set(config) - _LLAVA_FIELDS)
    if unknown:
        log.warning("config.json fields %s are not read by tokenmill (llava); check they do not change the output",
                    unknown)
    cfg = text_model_config(config, generation_config, text_reader)
    vision = vision_from_hf(config)
    if not 0 <= vision.image_token_id < cfg.vocab_size:
        raise ValueError(f"config.json image_token_index {vision.image_token_id} is outside the text model's "
                         f"vocabulary of {cfg.vocab_size}")
    return dataclasses.replace(cfg, architecture=str(config.get("model_type", "llava")), vision=vision)
