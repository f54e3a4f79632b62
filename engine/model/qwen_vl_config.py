"""A Qwen2.5-VL, Qwen2-VL or Qwen3-VL `config.json` (model_type "qwen2_5_vl" / "qwen2_vl" / "qwen3_vl") as a
ModelConfig: the language model's fields through the Qwen2 reader (Qwen3's for Qwen3-VL; engine.model.hf_config),
the vision tower's as a QwenVisionConfig (Qwen3VisionConfig; engine.vision_config) with the M-RoPE sections. Both
layouts are read: the hub checkpoints' (the text model's fields at the top level, `rope_scaling: {"type": "mrope",
"mrope_section": [...]}`) and transformers 5's (a nested `text_config` whose `rope_parameters` holds mrope_section;
Qwen3-VL's hub configs are nested too). Sources: HF
transformers' Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig and their vision configs (the defaults below are
theirs); Bai et al., "Qwen2.5-VL Technical Report" (2025); Wang et al., "Qwen2-VL" (2024); Qwen team, "Qwen3-VL
Technical Report" (2025).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from engine.config import ModelConfig
from engine.vision_config import Qwen3VisionConfig, QwenVisionConfig

log = logging.getLogger(__name__)

#: Top-level fields of the VL config that are not the text model's (the hub layout mixes both).
_VL_FIELDS = frozenset({"model_type", "architectures", "transformers_version", "vision_config", "text_config",
                        "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                        "vision_token_id", "_name_or_path"})
#: HF's vision config defaults per family (Qwen2_5_VLVisionConfig, Qwen2VLVisionConfig, Qwen3VLVisionConfig), in
#: Qwen2.5-VL's names.
_DEFAULTS = {
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       hidden_act="silu", window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4, num_heads=16, hidden_act="quick_gelu"),
    "qwen3_vl": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=3584,
                     hidden_act="gelu_pytorch_tanh", patch_size=16, num_position_embeddings=2304,
                     deepstack_visual_indexes=[8, 16, 24]),
}
_VISION_READ = frozenset({"depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "embed_dim",
                          "mlp_ratio", "patch_size", "spatial_patch_size", "spatial_merge_size", "temporal_patch_size",
                          "in_channels", "in_chans", "hidden_act", "window_size", "fullatt_block_indexes",
                          "rope_parameters", "model_type", "tokens_per_second", "initializer_range", "torch_dtype",
                          "dtype", "_name_or_path", "transformers_version", "architectures",
                          "num_position_embeddings", "deepstack_visual_indexes"})
#: M-RoPE's sections when the config names none (HF's defaults: Qwen2(.5)-VL's, Qwen3VLTextRotaryEmbedding's).
_MROPE_DEFAULT = {"qwen2_5_vl": (16, 24, 24), "qwen2_vl": (16, 24, 24), "qwen3_vl": (24, 20, 20)}


def _text_and_mrope(config: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(the text model's config dict for the Qwen2 reader (Qwen3's for qwen3_vl), mrope_section). Raises ValueError for
    a RoPE type other than M-RoPE over default RoPE, or interleaved M-RoPE for Qwen2(.5)-VL (Qwen3-VL's alone: HF's
    Qwen3-VL interleaves whatever its mrope_interleaved says)."""
    family = config.get("model_type")
    nested = config.get("text_config")
    text = dict(nested) if nested else {k: v for k, v in config.items() if k not in _VL_FIELDS}
    if "tie_word_embeddings" in config:  # transformers 5 keeps it at the top level only
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    rope = dict(text.pop("rope_scaling", None) or text.pop("rope_parameters", None) or {})
    text.pop("rope_parameters", None)
    text.pop("use_mrope", None)  # Qwen2-VL's flag: M-RoPE is what this model runs
    kinds = {rope.pop("type", None), rope.pop("rope_type", None)} - {None, "default", "mrope"}
    if kinds:
        raise ValueError(f"config.json rope type {sorted(kinds)} is not implemented for {config.get('model_type')}; "
                         "tokenmill runs M-RoPE over default RoPE")
    if rope.pop("mrope_interleaved", False) and family != "qwen3_vl":
        raise ValueError(f"config.json sets mrope_interleaved for {family}; tokenmill runs Qwen2-VL's sectioned "
                         "M-RoPE for it (interleaved: Qwen3-VL's)")
    sections = tuple(int(s) for s in rope.pop("mrope_section", _MROPE_DEFAULT[str(family)]))
    if "rope_theta" in rope:
        text["rope_theta"] = rope.pop("rope_theta")
    if rope:
        raise ValueError(f"config.json rope fields {sorted(rope)} are not implemented for {config.get('model_type')}")
    if family == "qwen3_vl":
        text.setdefault("rope_theta", 500000.0)  # Qwen3VLTextConfig's default_theta
    text["model_type"] = "qwen3" if family == "qwen3_vl" else "qwen2"
    return text, sections


def qwen_vision_from_hf(config: dict[str, Any], sections: tuple[int, ...]) -> QwenVisionConfig:
    """The QwenVisionConfig of a qwen2_5_vl / qwen2_vl config.json dict, the Qwen3VisionConfig of a qwen3_vl one (its
    vision_config, image_token_id and the M-RoPE sections). Raises ValueError naming a field tokenmill does not
    implement or a missing image token."""
    family = str(config["model_type"])
    vision = _DEFAULTS[family] | dict(config.get("vision_config") or {})
    unread = sorted(set(vision) - _VISION_READ)
    if unread:
        log.warning("config.json vision_config fields %s are not read by tokenmill (%s); check they do not change the "
                    "output", unread, family)
    rope = dict(vision.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ValueError(f"config.json vision_config rope_type {rope['rope_type']!r} is not implemented; tokenmill "
                         "runs the 2D (axial) rotary embedding")
    token = config.get("image_token_id")
    if not isinstance(token, int):
        raise ValueError(f"config.json of {family} has no image_token_id (the <|image_pad|> placeholder)")
    if family == "qwen2_vl":  # embed_dim is the tower's width, hidden_size the merger's output
        width = int(vision["embed_dim"])
        shape = dict(hidden_size=width, intermediate_size=int(width * vision["mlp_ratio"]),
                     out_hidden_size=int(vision["hidden_size"]), style="layer", window_size=0)
    elif family == "qwen3_vl":  # LayerNorm blocks, full attention, a learned position grid, DeepStack
        shape = dict(hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
                     out_hidden_size=int(vision["out_hidden_size"]), style="layer", window_size=0,
                     num_position_embeddings=int(vision["num_position_embeddings"]),
                     deepstack_visual_indexes=tuple(vision["deepstack_visual_indexes"]))
    else:
        shape = dict(hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
                     out_hidden_size=int(vision["out_hidden_size"]), style="rms",
                     window_size=int(vision["window_size"]),
                     fullatt_block_indexes=tuple(vision["fullatt_block_indexes"]))
    kind = Qwen3VisionConfig if family == "qwen3_vl" else QwenVisionConfig
    return kind(
        num_layers=int(vision["depth"]), num_heads=int(vision["num_heads"]),
        patch_size=int(vision.get("patch_size", vision.get("spatial_patch_size", 14))),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))), hidden_act=str(vision["hidden_act"]),
        rope_theta=float(rope.get("rope_theta", 10000.0)), image_token_id=token, mrope_section=sections, **shape)


def qwen_vl_from_hf(config: dict[str, Any], generation_config: dict[str, Any] | None,
                    text_reader: Callable[[dict[str, Any], dict[str, Any] | None], ModelConfig]) -> ModelConfig:
    """ModelConfig (architecture "qwen2_5_vl", "qwen2_vl" or "qwen3_vl", `vision` set) of such a config.json dict;
    `text_reader` is engine.model.hf_config.config_from_hf (passed in: it imports this module). Raises ValueError as
    qwen_vision_from_hf or the Qwen2 / Qwen3 reader, when the vision tower's output width is not the text model's,
    when RoPE is scaled (M-RoPE runs over default RoPE), when mrope_section does not cover head_dim / 2, or when
    DeepStack feeds more layers than the text model has."""
    text, sections = _text_and_mrope(config)
    cfg = text_reader(text, generation_config)
    if cfg.rope_scaling is not None or cfg.sliding_window is not None:
        raise ValueError(f"config.json of {config['model_type']} sets a scaled RoPE or a sliding window; tokenmill "
                         "runs its M-RoPE over default RoPE with full attention")
    vision = qwen_vision_from_hf(config, sections)
    if sum(sections) * 2 != (cfg.rotary_dim or cfg.head_dim):
        raise ValueError(f"config.json rope mrope_section {list(sections)} covers {sum(sections)} rotary frequencies; "
                         f"the text model's head_dim {cfg.head_dim} has {cfg.head_dim // 2}")
    if vision.out_hidden_size != cfg.hidden_size:
        raise ValueError(f"config.json vision_config out_hidden_size {vision.out_hidden_size} is not the text "
                         f"model's hidden_size {cfg.hidden_size}")
    deepstack = len(getattr(vision, "deepstack_visual_indexes", ()))
    if deepstack > cfg.num_layers:
        raise ValueError(f"config.json vision_config deepstack_visual_indexes feed {deepstack} decoder layers; the "
                         f"text model has {cfg.num_layers}")
    if not 0 <= vision.image_token_id < cfg.vocab_size:
        raise ValueError(f"config.json image_token_id {vision.image_token_id} is outside the text model's vocabulary "
                         f"of {cfg.vocab_size}")
    return dataclasses.replace(cfg, architecture=str(config["model_type"]), vision=vision)
