"""sentence-transformers' Dense modules (engine.pooling.st_config.DenseConfig) with their weights: a linear layer
and an activation over the pooled vectors, before Normalize. Run in float32, as the pooled vectors are.

Source: sentence-transformers' Dense (base/modules/dense.py): forward = activation(linear(x)), plus x (same widths)
or residual(x) (a Linear without bias) with use_residual; its weights `linear.weight`, `linear.bias`,
`residual.weight` in the module folder's model.safetensors, or pytorch_model.bin in older saves.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from engine.pooling.st_config import DenseConfig

#: DenseConfig.activation -> the function (torch's defaults: GELU exact, as nn.GELU()).
ACTIVATIONS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": F.relu, "gelu": F.gelu,
               "sigmoid": torch.sigmoid, "silu": F.silu}


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a module folder: model.safetensors, else pytorch_model.bin (read weights_only)."""
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{folder} has neither model.safetensors nor pytorch_model.bin: the Dense module's weights")


class Dense:
    """One Dense module, weights loaded float32 on `device`.

    Args:
        config: its shape and activation (engine.pooling.st_config.DenseConfig).
        device: where the pooled vectors are.

    Raises:
        ValueError: no weights file, a tensor missing, extra or of another shape than the config says (naming it).
    """

    def __init__(self, config: DenseConfig, device: torch.device) -> None:
        self.config = config
        state = _read_weights(Path(config.folder))
        shapes = {"linear.weight": (config.out_features, config.in_features)}
        if config.bias:
            shapes["linear.bias"] = (config.out_features,)
        if config.residual and config.in_features != config.out_features:
            shapes["residual.weight"] = (config.out_features, config.in_features)
        got = {k: tuple(v.shape) for k, v in state.items()}
        if got != shapes:
            raise ValueError(f"{config.folder}: the Dense module's tensors are {got}, its config.json says {shapes}")
        self.weights = {k: v.to(device=device, dtype=torch.float32) for k, v in state.items()}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [B, in_features] -> float32 [B, out_features]."""
        w = self.weights
        out = ACTIVATIONS[self.config.activation](F.linear(x, w["linear.weight"], w.get("linear.bias")))
        if self.config.residual:
            out = out + (F.linear(x, w["residual.weight"]) if "residual.weight" in w else x)
        return out
