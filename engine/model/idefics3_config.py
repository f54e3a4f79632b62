"""An Idefics3 or SmolVLM `config.json` (HF Idefics3Config: model_type "idefics3"; SmolVLMConfig: "smolvlm", the same
architecture) as a ModelConfig: the Llama text model's fields from the nested `text_config` (engine.model.llava_config.
text_model_config), the SigLIP vision encoder's and the connector's as a VisionConfig (engine.vision_config: its
`scale_factor` is the connector's pixel shuffle). Sources: Laurençon et al., "Building and better understanding
vision-language models: insights and future directions" (Idefics3, 2024); Marafioti et al., "SmolVLM: Redefining small
and efficient multimodal models" (2025); HF transformers' Idefics3Config, SmolVLMConfig and their vision configs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from engine.config import ModelConfig
from engine.model.llava_config import completed, text_model_config
from engine.vision_config import VisionConfig

log = logging.getLogger(__name__)

#: HF model_type of the top-level config -> the model_type its vision_config defaults to.
VISION_TYPES = {"idefics3": "idefics3_vision", "smolvlm": "smolvlm_vision"}
#: HF's defaults of the top-level fields (Idefics3Config, SmolVLMConfig) and of the text config's RMSNorm epsilon.
DEFAULT_IMAGE_TOKEN_ID, DEFAULT_SCALE_FACTOR, DEFAULT_TEXT_RMS_EPS = 128257, 2, 1e-5
#: Top-level fields read here or that do not change inference.
_FIELDS = frozenset({
    "model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "text_config",
    "vision_config", "image_token_id", "scale_factor", "tie_word_embeddings", "pad_token_id", "_pad_token_id",
    "use_cache", "vocab_size", "initializer_range", "bos_token_id", "eos_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder"})
_VISION_READ = frozenset({"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_channels", "image_size", "patch_size", "hidden_act", "layer_norm_eps",
                          "attention_dropout", "initializer_range", "max_image_size", "size"})


def idefics3_from_hf(config: dict[str, Any], generation_config: dict[str, Any] | None,
                     text_reader: Callable[[dict[str, Any], dict[str, Any] | None], ModelConfig]) -> ModelConfig:
    """ModelConfig of an Idefics3 / SmolVLM config.json dict, architecture "idefics3", `vision` set (feature layer
    the last, no CLS row, projector without bias: the connector is one Linear). `text_reader` as engine.model.
    llava_config.text_model_config's. Raises ValueError naming a field tokenmill does not implement (a text model
    outside llava_config.TEXT_MODEL_TYPES, a vision tower of another model_type, an activation outside
    engine.vision_config.VISION_ACTS, a scale_factor that does not divide the patch grid), or an image token outside
    the vocabulary."""
    model_type = str(config.get("model_type"))
    if model_type not in VISION_TYPES:
        raise ValueError(f"config.json model_type {model_type!r} is not Idefics3's; the idefics3 reader runs "
                         f"{list(VISION_TYPES)}")
    unknown = sorted(set(config) - _FIELDS)
    if unknown:
        log.warning("config.json fields %s are not read by tokenmill (%s); check they do not change the output",
                    unknown, model_type)
    cfg = text_model_config(config, generation_config, text_reader, "idefics3", {"rms_norm_eps": DEFAULT_TEXT_RMS_EPS})
    sub = dict(config.get("vision_config") or {})
    if sub.get("model_type") == model_type:  # the hub's Idefics3 and SmolVLM (v1) configs tag their vision config
        sub["model_type"] = VISION_TYPES[model_type]  # "idefics3"; HF's config class builds its vision class anyway
    vision = completed(sub, VISION_TYPES[model_type], tuple(VISION_TYPES.values()), "vision_config", "idefics3")
    unread = sorted(set(vision) - _VISION_READ)
    if unread:
        log.warning("config.json vision_config fields %s are not read by tokenmill (%s); check they do not change "
                    "the output", unread, model_type)
    token = int(config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
    if not 0 <= token < cfg.vocab_size:
        raise ValueError(f"config.json image_token_id {token} is outside the text model's vocabulary of "
                         f"{cfg.vocab_size}")
    v = VisionConfig(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
        image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]), image_token_id=token,
        num_channels=int(vision["num_channels"]), layer_norm_eps=float(vision["layer_norm_eps"]),
        hidden_act=str(vision["hidden_act"]), feature_layer=-1, select_strategy="default", projector_bias=False,
        scale_factor=int(config.get("scale_factor", DEFAULT_SCALE_FACTOR)))
    return dataclasses.replace(cfg, architecture="idefics3", vision=v)
