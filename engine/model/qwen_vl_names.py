"""The parameter names and shapes of Qwen2-VL / Qwen2.5-VL / Qwen3-VL beyond the decoder's
(engine.model.tensor_names): the vision transformer and its mergers under `visual.` (engine.model.qwen_vision,
engine.model.qwen3_vision; HF's names). No torch: the CLI's fit check reads them (engine.model.registry)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.model.tensor_names import param_shapes
from engine.vision_config import Qwen3VisionConfig, QwenVisionConfig


def _block_shapes(v: QwenVisionConfig, mlp: tuple[tuple[str, int, int], ...]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tower's blocks (`blocks.{n}.*`): their norms (LayerNorm with biases for style "layer",
    RMSNorm weights else), the biased qkv and proj, and the biased MLP linears `mlp` ((name, rows, columns), ...)."""
    d = v.hidden_size
    norm = ("weight", "bias") if v.style == "layer" else ("weight",)
    shapes: dict[str, tuple[int, ...]] = {}
    for n in range(v.num_layers):
        b = f"blocks.{n}"
        shapes |= {f"{b}.{name}.{p}": (d,) for name in ("norm1", "norm2") for p in norm}
        shapes[f"{b}.attn.qkv.weight"], shapes[f"{b}.attn.qkv.bias"] = (3 * d, d), (3 * d,)
        shapes[f"{b}.attn.proj.weight"], shapes[f"{b}.attn.proj.bias"] = (d, d), (d,)
        for name, rows, cols in mlp:
            shapes[f"{b}.mlp.{name}.weight"], shapes[f"{b}.mlp.{name}.bias"] = (rows, cols), (rows,)
    return shapes


def qwen_vision_shapes(v: QwenVisionConfig, prefix: str = "visual.") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of engine.model.qwen_vision.QwenVisionTower of shape `v`, under `prefix`."""
    d, i, layer_norm = v.hidden_size, v.intermediate_size, v.style == "layer"
    wide = d * v.spatial_merge_size ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "merger.mlp.0.weight": (wide, wide), "merger.mlp.0.bias": (wide,),
        "merger.mlp.2.weight": (v.out_hidden_size, wide), "merger.mlp.2.bias": (v.out_hidden_size,),
    }
    shapes |= {f"merger.ln_q.{p}": (d,) for p in (("weight", "bias") if layer_norm else ("weight",))}
    mlp = (("fc1", i, d), ("fc2", d, i)) if layer_norm else (
        ("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i))
    shapes |= _block_shapes(v, mlp)
    return {prefix + name: shape for name, shape in shapes.items()}


def qwen3_vision_shapes(v: Qwen3VisionConfig, prefix: str = "visual.") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of engine.model.qwen3_vision.Qwen3VisionTower of shape `v`, under `prefix`:
    the biased patch embedding, the learned position table, the blocks, the merger and the DeepStack mergers."""
    d, i, out = v.hidden_size, v.intermediate_size, v.out_hidden_size
    wide = d * v.spatial_merge_size ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "patch_embed.proj.bias": (d,), "pos_embed.weight": (v.num_position_embeddings, d),
    }
    mergers = [("merger", d)] + [(f"deepstack_merger_list.{k}", wide) for k in range(len(v.deepstack_visual_indexes))]
    for name, norm in mergers:  # the main merger normalises each patch, DeepStack's the joined row
        shapes |= {f"{name}.norm.weight": (norm,), f"{name}.norm.bias": (norm,),
                   f"{name}.linear_fc1.weight": (wide, wide), f"{name}.linear_fc1.bias": (wide,),
                   f"{name}.linear_fc2.weight": (out, wide), f"{name}.linear_fc2.bias": (out,)}
    shapes |= _block_shapes(v, (("fc1", i, d), ("fc2", d, i)))  # HF's mlp.linear_fc1 / fc2, renamed on load
    return {prefix + name: shape for name, shape in shapes.items()}


def qwen_vl_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the qwen_vl model (engine.model.qwen_vl) of shape `cfg` (a tied LM head
    left out): the decoder's and the vision tower's. Raises ValueError for a config without a QwenVisionConfig."""
    if not isinstance(cfg.vision, QwenVisionConfig):
        raise ValueError(f"a qwen_vl model needs a QwenVisionConfig; the {cfg.architecture} config has "
                         f"{type(cfg.vision).__name__}")
    return param_shapes(cfg) | qwen_vision_shapes(cfg.vision)


def qwen3_vl_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the qwen3_vl model (engine.model.qwen3_vl) of shape `cfg` (a tied LM head
    left out): the Qwen3 decoder's and the vision tower's. Raises ValueError for a config without a
    Qwen3VisionConfig."""
    if not isinstance(cfg.vision, Qwen3VisionConfig):
        raise ValueError(f"a qwen3_vl model needs a Qwen3VisionConfig; the {cfg.architecture} config has "
                         f"{type(cfg.vision).__name__}")
    return param_shapes(cfg) | qwen3_vision_shapes(cfg.vision)
