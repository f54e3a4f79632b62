"""The interface of a held form of a linear's weight (engine.quant.forms: the forms and their table, HELD_FORMS):
create, process after load, apply (vLLM's LinearMethodBase: create_weights / process_weights_after_loading /
apply), and what the engine asks of any held weight without switching on its type (its shape, its memory-fit
fields, its float tensor, the form instance that serves it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from engine.quant.state import AddBias

META = torch.device("meta")


class HeldForm(ABC):
    """One held form of a linear's weight (module docstring): create, process after load, apply.

    Class attributes:
        name: its key in HELD_FORMS.
        held_type: the type of its held weight (what a quantized state dict holds for it).
        served_by: device type ("cpu", "cuda") -> dotted name of the module or kernel that serves it there.
        tolerance: the largest max|y - y_ref| / max|y_ref| it gives on a random Gaussian linear in fp32 on the CPU
            against the fp32 weights it was made from (what tests/engine/quant/test_held_forms.py holds it to).
    Args:
        dtype: the activations' (compute) dtype.
        device: where the serving module lives.
    """

    name: ClassVar[str]
    held_type: ClassVar[type]
    served_by: ClassVar[Mapping[str, str]]
    tolerance: ClassVar[float]

    def __init__(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.dtype, self.device = dtype, torch.device(device)

    @abstractmethod
    def create(self, out_features: int, in_features: int) -> Any:
        """The empty held weight [out_features, in_features] on the meta device."""

    @abstractmethod
    def process_after_load(self, weight: Any, bias: torch.Tensor | None = None) -> nn.Module:
        """The serving module on `self.device` of a loaded held weight (and a bias [N], or None)."""

    def process_embedding(self, weight: Any) -> nn.Module:
        """The serving embedding module of a loaded held weight [num_embeddings, dim]. Raises ValueError: a form
        serves linears only unless it overrides this (Int4GroupForm)."""
        raise ValueError(f"held form {self.name!r} serves linears only, not an embedding; hold the embedding dense")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b: x [..., K] -> [..., N] through `layer` (process_after_load's module)."""
        return layer(x)

    @classmethod
    def for_weight(cls, weight: Any, dtype: torch.dtype, device: torch.device | str, *,
                   dequant_min_rows: int | None | str = "auto", layout: str = "dual") -> HeldForm:
        """The form instance that serves the held weight `weight` in `dtype` on `device` (its group size, type or
        expert count read from it; dequant_min_rows and layout: the INT4 forms' kernel options, ignored by others)."""
        return cls(dtype, device)

    @staticmethod
    @abstractmethod
    def held_shape(weight: Any) -> tuple[int, ...]:
        """The logical shape of a held weight: (out_features, in_features), (E, N, K) for stacked experts."""

    @staticmethod
    @abstractmethod
    def held_fields(weight: Any) -> tuple:
        """What engine.worker.memory_fit.weight_bytes counts of a held weight (HeldWeight's fields): (numel, INT4
        group size or None), or for stacked experts (numel, group, True, bytes per scale as stored)."""

    @staticmethod
    @abstractmethod
    def to_float(weight: Any, dtype: torch.dtype) -> torch.Tensor:
        """The held weight as a float tensor of its logical shape: a quantized one dequantized to `dtype` (exact
        arithmetic in fp32, then cast), a plain tensor as it is (fill_model casts it)."""

    @classmethod
    def kernel_for(cls, device: torch.device | str) -> str:
        """The dotted name of what serves this form on `device`. Raises ValueError where nothing does."""
        kind = torch.device(device).type
        if kind not in cls.served_by:
            raise ValueError(f"held form {cls.name!r} has no kernel on {kind} (served on {', '.join(cls.served_by)}); "
                             "load the model with quantization 'none' there")
        return cls.served_by[kind]


def with_bias(module: nn.Module, bias: torch.Tensor | None, dtype: torch.dtype,
               device: torch.device) -> nn.Module:
    """`module` with `bias` added after it (AddBias, bias cast to `dtype` on `device`), or as it is without one."""
    if bias is None:
        return module
    return AddBias(module, nn.Parameter(bias.detach().to(device, dtype), requires_grad=False))
