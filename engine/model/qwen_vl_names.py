"""The parameter names and shapes of Qwen2-VL / Qwen2.5-VL beyond the decoder's (engine.model.tensor_names): the vision
transformer and patch merger under `visual.` (engine.model.qwen_vision; HF's names). No torch: the CLI's fit check
reads them (engine.model.registry)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.model.tensor_names import param_shapes
from engine.vision_config import QwenVisionConfig


def qwen_vision_shapes(v: QwenVisionConfig, prefix: str = "visual.") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of engine.model.qwen_vision.QwenVisionTower of shape `v`, under `prefix`."""
    d, i, layer_norm = v.hidden_size, v.intermediate_size, v.style == "layer"
    norm = ("weight", "bias") if layer_norm else ("weight",)
    wide = d * v.spatial_merge_size ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "merger.mlp.0.weight": (wide, wide), "merger.mlp.0.bias": (wide,),
        "merger.mlp.2.weight": (v.out_hidden_size, wide), "merger.mlp.2.bias": (v.out_hidden_size,),
    }
    shapes |= {f"merger.ln_q.{p}": (d,) for p in norm}
    mlp = (("fc1", i, d), ("fc2", d, i)) if layer_norm else (
        ("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i))
    for n in range(v.num_layers):
        b = f"blocks.{n}"
        shapes |= {f"{b}.{name}.{p}": (d,) for name in ("norm1", "norm2") for p in norm}
        shapes[f"{b}.attn.qkv.weight"], shapes[f"{b}.attn.qkv.bias"] = (3 * d, d), (3 * d,)
        shapes[f"{b}.attn.proj.weight"], shapes[f"{b}.attn.proj.bias"] = (d, d), (d,)
        for name, rows, cols in mlp:
            shapes[f"{b}.mlp.{name}.weight"], shapes[f"{b}.mlp.{name}.bias"] = (rows, cols), (rows,)
    return {prefix + name: shape for name, shape in shapes.items()}


def qwen_vl_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the qwen_vl model (engine.model.qwen_vl) of shape `cfg` (a tied LM head
    left out): the decoder's and the vision tower's. Raises ValueError for a config without a QwenVisionConfig."""
    if not isinstance(cfg.vision, QwenVisionConfig):
        raise ValueError(f"a qwen_vl model needs a QwenVisionConfig; the {cfg.architecture} config has "
                         f"{type(cfg.vision).__name__}")
    return param_shapes(cfg) | qwen_vision_shapes(cfg.vision)
