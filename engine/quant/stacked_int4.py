"""One projection of every expert of a mixture-of-experts layer in the portable INT4 format (engine.quant.qparams),
stacked over the experts: what the grouped INT4 GEMMs of engine.kernels.triton_moe_int4 read.

Each expert's Int4Weight keeps its layout (byte j of a row: element 2j in the high nibble, 2j + 1 in the low one;
w = (q - 8) * scale + zero per group of `group_size` input features); the stack adds a leading expert dimension.
Act-order checkpoints (GPTQ desc_act: Int4Weight.in_perm, column j multiplies x[in_perm[j]]) are served: the stack
keeps one permutation per expert (the identity for an expert without one) and the kernel gathers the activations'
columns in that order, as Int4Linear gathers x's features.

Imports qparams only. The loaders build them (a state dict's stacked experts: engine.quant.state), engine.quant.experts
hands them to engine.layers.moe.GroupedExperts (which holds them without importing this module: engine.quant imports
engine.layers); the kernel does not import it either (engine.quant imports engine.kernels) and reads its fields
(engine.kernels.triton_moe_int4.Int4Experts names them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.quant.qparams import Int4Weight


@dataclass(frozen=True, eq=False)
class StackedInt4:
    """E experts' INT4 weights of one projection, [E, N, K] once dequantized.

    Attributes:
        qweight: uint8 [E, N, Kp / 2] (Kp = in_features rounded up to a multiple of group_size).
        scales, zeros: float [E, N, Kp / group_size] (bf16 from a checkpoint, fp32 from GGUF), one dtype.
        in_features: K, the unpadded input width.
        group_size: input features per (scale, zero) group (32, 64, 128 or 256).
        in_perm: None, or int64 [E, K]: expert e's column j multiplies x[..., in_perm[e, j]] (act-order).
    Raises ValueError (at construction) when the shapes, dtypes or devices disagree, naming the part.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    in_features: int
    group_size: int
    in_perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        parts = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros, "in_perm": self.in_perm}
        experts = self.qweight.shape[0] if self.qweight.dim() else 0
        for name, t in parts.items():
            if t is not None and (t.dim() != (2 if name == "in_perm" else 3) or t.shape[0] != experts):
                raise ValueError(f"{name} must be stacked over the experts ([E, ...] with E = qweight's "
                                 f"{experts}), got shape {tuple(t.shape)}")
        if experts == 0:
            raise ValueError("a StackedInt4 needs at least one expert")
        self.expert(0)  # Int4Weight's checks of one expert's parts (shapes, dtypes) hold for all: same shapes
        if not self.scales.is_floating_point() or self.zeros.dtype != self.scales.dtype:
            raise ValueError(f"scales and zeros must share one float dtype, got {self.scales.dtype} and "
                             f"{self.zeros.dtype}")
        devices = {str(t.device) for t in parts.values() if t is not None}
        if len(devices) > 1:
            raise ValueError(f"the stacked INT4 parts are on different devices: {sorted(devices)}")

    @classmethod
    def from_weights(cls, weights: Sequence[Int4Weight]) -> StackedInt4:
        """Stack one Int4Weight per expert (expert e = weights[e]); copies them into new [E, ...] tensors.

        Raises ValueError for an empty list, or experts whose out_features, in_features, group size, scale dtype or
        device differ (naming the first expert that differs from expert 0)."""
        if not weights:
            raise ValueError("StackedInt4.from_weights needs one Int4Weight per expert, got none")
        first = weights[0]

        def key(w: Int4Weight) -> tuple[object, ...]:
            return (w.out_features, w.in_features, w.group_size, w.scales.dtype, w.zeros.dtype, w.qweight.device)

        for e, w in enumerate(weights):
            if key(w) != key(first):
                raise ValueError(f"expert {e}'s INT4 weight (out, in, group, scale and zero dtypes, device) {key(w)} "
                                 f"differs from expert 0's {key(first)}: the experts of one projection must match")
        perm = None
        if any(w.in_perm is not None for w in weights):
            identity = torch.arange(first.in_features, dtype=torch.int64, device=first.qweight.device)
            perm = torch.stack([identity if w.in_perm is None else w.in_perm.to(identity.device) for w in weights])
        return cls(torch.stack([w.qweight for w in weights]), torch.stack([w.scales for w in weights]),
                   torch.stack([w.zeros for w in weights]), first.in_features, first.group_size, perm)

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def padded_in_features(self) -> int:
        return self.qweight.shape[2] * 2

    def expert(self, e: int) -> Int4Weight:
        """Expert e's weight as an Int4Weight (views, no copy)."""
        return Int4Weight(self.qweight[e], self.scales[e], self.zeros[e], self.in_features, self.group_size,
                          None if self.in_perm is None else self.in_perm[e])

    def to(self, device: torch.device | str | None = None, scale_dtype: torch.dtype | None = None) -> StackedInt4:
        """A copy on `device` with scales and zeros in `scale_dtype` (None keeps them)."""
        dt = scale_dtype or self.scales.dtype
        perm = None if self.in_perm is None else self.in_perm.to(device)
        return dataclasses.replace(self, qweight=self.qweight.to(device), scales=self.scales.to(device, dt),
                                   zeros=self.zeros.to(device, dt), in_perm=perm)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights as `dtype` [E, N, K], each expert as Int4Weight.dequantize computes it (fp32 arithmetic,
        padding dropped, in_perm undone)."""
        return torch.stack([self.expert(e).dequantize(dtype) for e in range(self.num_experts)])
