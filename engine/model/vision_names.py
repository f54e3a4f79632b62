"""The parameter names and shapes of a vision-language model beyond its decoder's (engine.model.tensor_names): the
CLIP vision tower's (`vision_tower.*`, CLIPVisionModel's names without "vision_model.") and LLaVA's projector's
(`multi_modal_projector.*`); Idefics3's SigLIP encoder (`vision_model.*`) and connector (`connector.*`); Gemma 3's
SigLIP tower (`vision_tower.*`) and projector (`multi_modal_projector.*`). No torch: the CLI's fit check reads them
(engine.model.registry)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.model.tensor_names import param_shapes
from engine.vision_config import VisionConfig


def encoder_layer_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the parameters of the encoder blocks (engine.model.clip_vision.ClipEncoder: CLIP's and
    SigLIP's), under "encoder.layers.N."."""
    d, i = v.hidden_size, v.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for n in range(v.num_layers):
        p = f"encoder.layers.{n}"
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{p}.{norm}.weight"] = shapes[f"{p}.{norm}.bias"] = (d,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{p}.self_attn.{proj}.weight"] = (d, d)
            shapes[f"{p}.self_attn.{proj}.bias"] = (d,)
        shapes[f"{p}.mlp.fc1.weight"], shapes[f"{p}.mlp.fc1.bias"] = (i, d), (i,)
        shapes[f"{p}.mlp.fc2.weight"], shapes[f"{p}.mlp.fc2.bias"] = (d, i), (d,)
    return shapes


def clip_vision_shapes(v: VisionConfig, prefix: str = "vision_tower.") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of engine.model.clip_vision.ClipVisionTower of shape `v`, under `prefix`."""
    d = v.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.class_embedding": (d,),
        "embeddings.patch_embedding.weight": (d, v.num_channels, v.patch_size, v.patch_size),
        "embeddings.position_embedding.weight": (v.num_patches + 1, d),
    }
    for norm in ("pre_layrnorm", "post_layernorm"):
        shapes[f"{norm}.weight"] = shapes[f"{norm}.bias"] = (d,)
    shapes |= encoder_layer_shapes(v)
    return {prefix + name: shape for name, shape in shapes.items()}


def siglip_shapes(v: VisionConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of engine.model.siglip_vision.SiglipVisionTower of shape `v`, under
    `prefix`."""
    d = v.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.patch_embedding.weight": (d, v.num_channels, v.patch_size, v.patch_size),
        "embeddings.patch_embedding.bias": (d,),
        "embeddings.position_embedding.weight": (v.num_patches, d),
        "post_layernorm.weight": (d,), "post_layernorm.bias": (d,),
    } | encoder_layer_shapes(v)
    return {prefix + name: shape for name, shape in shapes.items()}


def _vision(cfg: ModelConfig) -> VisionConfig:
    """cfg.vision; raises ValueError naming the architecture when the config has none."""
    if not isinstance(cfg.vision, VisionConfig):
        raise ValueError(f"a {cfg.architecture} model needs ModelConfig.vision; its config has none")
    return cfg.vision


def idefics3_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the idefics3 model (engine.model.idefics3) of shape `cfg` (a tied LM head
    left out): the decoder's, the SigLIP encoder's (`vision_model.*`) and the connector's. Raises ValueError for a
    config without `vision`."""
    v = _vision(cfg)
    return (param_shapes(cfg) | siglip_shapes(v, "vision_model.")
            | {"connector.modality_projection.proj.weight": (cfg.hidden_size, v.hidden_size * v.scale_factor ** 2)})


def gemma3_vl_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the gemma3_vl model (engine.model.gemma3_vl) of shape `cfg` (a tied LM head
    left out): the decoder's, the SigLIP tower's (`vision_tower.*`) and the projector's (its RMSNorm weight and
    projection matrix [vision width, text width]). Raises ValueError for a config without `vision`."""
    v = _vision(cfg)
    return (param_shapes(cfg) | siglip_shapes(v, "vision_tower.")
            | {"multi_modal_projector.mm_soft_emb_norm.weight": (v.hidden_size,),
               "multi_modal_projector.mm_input_projection_weight": (v.hidden_size, cfg.hidden_size)})


def llava_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the llava model (engine.model.llava) of shape `cfg` (a tied LM head left
    out): the decoder's, the vision tower's and the projector's. Raises ValueError for a config without `vision`."""
    v = _vision(cfg)
    shapes = param_shapes(cfg) | clip_vision_shapes(v)
    shapes["multi_modal_projector.linear_1.weight"] = (cfg.hidden_size, v.hidden_size)
    shapes["multi_modal_projector.linear_2.weight"] = (cfg.hidden_size, cfg.hidden_size)
    if v.projector_bias:
        shapes["multi_modal_projector.linear_1.bias"] = shapes["multi_modal_projector.linear_2.bias"] = (
            cfg.hidden_size,)
    return shapes


def llava_next_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """llava_param_shapes plus LLaVA-NeXT's `image_newline` [hidden] (engine.model.llava_next)."""
    return llava_param_shapes(cfg) | {"image_newline": (cfg.hidden_size,)}
