"""A Gemma 3 vision-language `config.json` (HF Gemma3Config: model_type "gemma3", Gemma3ForConditionalGeneration)
as a ModelConfig of architecture "gemma3_vl": the Gemma 3 text model's fields from the nested `text_config` through
the gemma3_text reader (engine.model.family_fields.gemma3_fields: sliding and global layers, two RoPE bases), the
SigLIP tower's and the projector's as a VisionConfig (engine.vision_config): the image token is the soft token each
image's features fill (`image_token_index`), and `scale_factor` the projector's average-pooling kernel, patches per
side over the sqrt(mm_tokens_per_image) tokens per side. Sources: Gemma Team, "Gemma 3 Technical Report" (2025); HF
transformers' Gemma3Config, Gemma3TextConfig, SiglipVisionConfig and Gemma3MultiModalProjector.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from engine.config import ModelConfig
from engine.model.llava_config import completed, text_model_config
from engine.vision_config import VisionConfig

log = logging.getLogger(__name__)

#: HF Gemma3Config's defaults of its top-level fields.
DEFAULT_TOKENS_PER_IMAGE, DEFAULT_IMAGE_TOKEN_ID = 256, 262144
#: Top-level fields read here or that do not change inference (boi / eoi are prompt tokens the processor writes).
_FIELDS = frozenset({
    "model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "text_config",
    "vision_config", "mm_tokens_per_image", "image_token_index", "image_token_id", "boi_token_index",
    "eoi_token_index", "boi_token_id", "eoi_token_id", "tie_word_embeddings", "initializer_range", "pad_token_id",
    "bos_token_id", "eos_token_id", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder"})
_VISION_READ = frozenset({"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_channels", "image_size", "patch_size", "hidden_act", "layer_norm_eps",
                          "attention_dropout", "vision_use_head"})  # the pooling head: HF's Gemma 3 never runs it


def pooling_kernel(image_size: int, patch_size: int, tokens_per_image: int) -> int:
    """The projector's average-pooling kernel (= stride) in patches: patches per side / sqrt(tokens_per_image).
    Raises ValueError unless tokens_per_image is a square whose side divides the patches per side (HF's
    Gemma3MultiModalProjector would then pool to another count)."""
    side = math.isqrt(max(tokens_per_image, 0))
    patches = image_size // patch_size
    if side < 1 or side * side != tokens_per_image or patches % side:
        raise ValueError(f"config.json mm_tokens_per_image {tokens_per_image} must be a square whose side divides the "
                         f"vision tower's {patches} patches per side")
    return patches // side


def gemma3_vl_from_hf(config: dict[str, Any], generation_config: dict[str, Any] | None,
                      text_reader: Callable[[dict[str, Any], dict[str, Any] | None], ModelConfig]) -> ModelConfig:
    """ModelConfig of a Gemma 3 config.json dict, architecture "gemma3_vl", `vision` set (the last hidden state, no CLS
    row, no projector bias; scale_factor the pooling kernel). `text_reader` is engine.model.hf_config.config_from_hf
    (passed in: it imports this module). Raises ValueError naming a field tokenmill does not implement (a text model
    other than gemma3_text, a vision tower other than SigLIP's, an activation outside engine.vision_config.
    VISION_ACTS, an mm_tokens_per_image that does not pool evenly: pooling_kernel), or an image token outside the
    vocabulary."""
    unknown = sorted(set(config) - _FIELDS)
    if unknown:
        log.warning("config.json fields %s are not read by tokenmill (gemma3); check they do not change the output",
                    unknown)
    cfg = text_model_config(config, generation_config, text_reader, "gemma3", text_types=("gemma3_text",))
    vision = completed(dict(config.get("vision_config") or {}), "siglip_vision_model", ("siglip_vision_model",),
                       "vision_config", "gemma3")
    unread = sorted(set(vision) - _VISION_READ)
    if unread:
        log.warning("config.json vision_config fields %s are not read by tokenmill (gemma3); check they do not "
                    "change the output", unread)
    token = int(config.get("image_token_index", config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID)))
    if not 0 <= token < cfg.vocab_size:
        raise ValueError(f"config.json image_token_index {token} is outside the text model's vocabulary of "
                         f"{cfg.vocab_size}")
    image_size, patch_size = int(vision["image_size"]), int(vision["patch_size"])
    kernel = pooling_kernel(image_size, patch_size, int(config.get("mm_tokens_per_image", DEFAULT_TOKENS_PER_IMAGE)))
    v = VisionConfig(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
        image_size=image_size, patch_size=patch_size, image_token_id=token, num_channels=int(vision["num_channels"]),
        layer_norm_eps=float(vision["layer_norm_eps"]), hidden_act=str(vision["hidden_act"]), feature_layer=-1,
        select_strategy="default", projector_bias=False, scale_factor=kernel)
    return dataclasses.replace(cfg, architecture="gemma3_vl", vision=v)
