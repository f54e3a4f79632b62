"""The held forms of a linear's weight, one class each, and the one table of them: HELD_FORMS.

A held form is how a weight sits in memory for its device's kernel, as opposed to how a file stores it (the stored
formats, each of which names the held form it becomes: engine.loading.stored_formats.STORED_FORMATS). Each class is
one held form with three steps, as vLLM's quantization methods are (vllm/model_executor/layers/quantization: a
LinearMethodBase's create_weights / process_weights_after_loading / apply):

    create(out_features, in_features)  the empty held weight of a linear of that shape, on the meta device: the
                                       parts and dtypes a reader fills (a loaded weight must have these shapes);
    process_after_load(weight, bias)   the serving module on the form's device: the weight repacked for the
                                       kernel (oneDNN's blocked layout, tinygemm's / GemLite's INT4 packing,
                                       oneDNN's int8 prepack), moved to the device; a bias kept (added in the
                                       GEMM's epilogue where the kernel has one, else after it: AddBias);
    apply(layer, x)                    y = x W^T + b through that module, x [..., K] -> [..., N].

Each class's `served_by` names, per device type, the module (or kernel function) that serves it there; a device it
does not name refuses the form (`kernel_for`). The class also answers, for a held weight of its form (`held_form_of`
finds the class), what the rest of the engine asks of any weight without switching on its type: its [out, in] shape
(`held_shape`), its memory-fit fields (`held_fields`), its float tensor (`to_float`) and the form instance that
serves it (`for_weight`); so a new form is one class here and one row of HELD_FORMS (the interface:
engine.quant.held_form.HeldForm). The model's loads build their quantized modules through these classes
(engine.quant.handler.build_model), the CPU's plain linears are packed through them
(engine.quant.after_load.pack_linears), and docs/architecture.md's table of weight forms by device is this one.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.gguf_blocks import BLOCK_SIZE, GGUFBlocks
from engine.layers.gguf_holder import GGUFBlocksHolder
from engine.model.base import ModelBase
from engine.quant.experts import expert_modules
from engine.quant.held_form import META, HeldForm, with_bias
from engine.quant.int4_linear import Int4Embedding, Int4Linear
from engine.quant.int8_linear import Int8Linear, quantize_model_int8
from engine.quant.packed_linear import PackedLinear, can_pack
from engine.quant.qparams import Int4Weight, Int8Weight, check_group_size, padded_in_features, quantize_int4
from engine.quant.smoothquant import smooth_model
from engine.quant.stacked_int4 import StackedInt4


class DenseForm(HeldForm):
    """The weight as a plain tensor [N, K] in the compute dtype (bf16 / fp32 / fp16). On the CPU packed for oneDNN
    (engine.quant.packed_linear.PackedLinear) where oneDNN packs the dtype, else (and on CUDA) an nn.Linear."""

    name = "dense"
    held_type = torch.Tensor
    served_by = {"cpu": "engine.quant.packed_linear.PackedLinear", "cuda": "torch.nn.Linear"}
    tolerance = 1e-5

    def create(self, out_features: int, in_features: int) -> torch.Tensor:
        return torch.empty(out_features, in_features, dtype=self.dtype, device=META)

    @staticmethod
    def held_shape(weight: torch.Tensor) -> tuple[int, ...]:
        return tuple(weight.shape)

    @staticmethod
    def held_fields(weight: torch.Tensor) -> tuple:
        return weight.numel(), None

    @staticmethod
    def to_float(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return weight

    def process_after_load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        w = weight.detach().to(self.device, self.dtype)
        if self.device.type == "cpu" and can_pack(self.dtype):
            return PackedLinear(w, None, bias)
        linear = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=META)
        linear.weight = nn.Parameter(w, requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach().to(self.device, self.dtype), requires_grad=False)
        return linear


class GGUFBlocksForm(HeldForm):
    """A GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K weight kept as its own blocks (engine.kernels.gguf_blocks.GGUFBlocks)
    beside its fp32 copy, on the CPU in fp32 only: decode steps of a few rows read the blocks
    (engine.kernels.gguf_blocks.gguf_linear, inside engine.quant.packed_linear.gguf_kernel_scope), the others the
    oneDNN-packed fp32 copy. Elsewhere the weight is held dense (its blocks dropped at load). From the fill to
    packing the blocks ride on the module holding the weight as its declared `holder` (a GGUFBlocksHolder child
    module: `attach`, `of`; engine.layers.gguf_holder), dropped when the weight changes in place.

    Args (beyond HeldForm's): type_name: the GGUF type of `create`'s blocks.
    """

    name = "gguf_blocks"
    held_type = GGUFBlocks
    holder = GGUFBlocksHolder
    served_by = {"cpu": "engine.quant.packed_linear.PackedLinear"}
    tolerance = 2e-2  # Q8_0 blocks made from fp32 weights (the test's type)

    def __init__(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 type_name: str = "Q8_0") -> None:
        super().__init__(dtype, device)
        self.type_name = type_name

    def create(self, out_features: int, in_features: int) -> GGUFBlocks:
        """Raises ValueError when in_features is not whole 32-weight blocks."""
        if in_features % BLOCK_SIZE:
            raise ValueError(f"GGUF blocks hold rows of whole {BLOCK_SIZE}-weight blocks, got in_features "
                             f"{in_features}; hold the weight dense")
        nb = in_features // BLOCK_SIZE
        q8 = self.type_name == "Q8_0"
        qs = torch.empty(out_features, nb, 32 if q8 else 16, dtype=torch.int8 if q8 else torch.uint8, device=META)
        scales = torch.empty(out_features, nb, dtype=torch.float32, device=META)
        return GGUFBlocks(self.type_name, qs, scales, None if q8 else torch.empty_like(scales))

    @classmethod
    def for_weight(cls, weight: GGUFBlocks, dtype: torch.dtype, device: torch.device | str, *,
                   dequant_min_rows: int | None | str = "auto", layout: str = "dual") -> GGUFBlocksForm:
        return cls(dtype, device, type_name=weight.type_name)

    @staticmethod
    def held_shape(weight: GGUFBlocks) -> tuple[int, ...]:
        return weight.shape

    @staticmethod
    def held_fields(weight: GGUFBlocks) -> tuple:
        return weight.shape[0] * weight.shape[1], None

    @staticmethod
    def to_float(weight: GGUFBlocks, dtype: torch.dtype) -> torch.Tensor:
        return weight.dequantize().to(dtype)

    @staticmethod
    def attach(module: nn.Module, blocks: GGUFBlocks | None) -> bool:
        """Give `module` (an nn.Linear, or stacked experts' ExpertWeights, with an fp32 weight of the blocks' rows)
        the holder of `blocks`. Returns False, attaching nothing, for no blocks or a weight they do not fit."""
        return GGUFBlocksHolder.attach(module, blocks)

    @staticmethod
    def of(module: nn.Module) -> GGUFBlocks | None:
        """The blocks held on `module`, or None when it has none or its weight changed since they were attached."""
        return GGUFBlocksHolder.of(module)

    def process_after_load(self, weight: GGUFBlocks, bias: torch.Tensor | None = None, *,
                           dense: torch.Tensor | None = None) -> nn.Module:
        """PackedLinear over `dense` (the fp32 weight the blocks were dequantized to, when the caller holds it; else
        dequantized here) with the blocks. Raises ValueError (as kernel_for) off the CPU or for a dtype but fp32."""
        self.kernel_for(self.device)
        if self.dtype != torch.float32:
            raise ValueError(f"GGUF blocks serve fp32 activations only, not {self.dtype}; hold the weight dense")
        return PackedLinear(weight.dequantize() if dense is None else dense, weight, bias)


class Int4GroupForm(HeldForm):
    """INT4 group-wise, W4A16 (engine.quant.qparams.Int4Weight: uint8 [N, Kp/2] plus scales and zeros per group of
    `group_size` input features), served by engine.quant.int4_linear.Int4Linear (CPU: bf16 `_weight_int4pack_mm_
    for_cpu`, fp32 dequantize + GEMM; CUDA: tinygemm, GemLite, dequantize + GEMM by rows) or, for an embedding,
    Int4Embedding.

    Args (beyond HeldForm's): group_size; dequant_min_rows and layout: Int4Linear's (CUDA only).
    """

    name = "int4"
    held_type = Int4Weight
    served_by = {"cpu": "engine.quant.int4_linear.Int4Linear", "cuda": "engine.quant.int4_linear.Int4Linear"}
    tolerance = 0.15  # round-to-nearest at group 32 of Gaussian weights (about 0.07 measured)

    def __init__(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 group_size: int = 128, dequant_min_rows: int | None | str = "auto", layout: str = "dual") -> None:
        super().__init__(dtype, device)
        check_group_size(group_size)
        self.group_size, self.dequant_min_rows, self.layout = group_size, dequant_min_rows, layout

    def create(self, out_features: int, in_features: int) -> Int4Weight:
        kp = padded_in_features(in_features, self.group_size)
        groups = torch.empty(out_features, kp // self.group_size, dtype=torch.bfloat16, device=META)
        return Int4Weight(torch.empty(out_features, kp // 2, dtype=torch.uint8, device=META), groups,
                          torch.empty_like(groups), in_features, self.group_size)

    @staticmethod
    def from_float(weight: torch.Tensor, group_size: int = 128,
                   scale_dtype: torch.dtype = torch.bfloat16) -> Int4Weight:
        """The held INT4 weight of a float weight [N, K] (any float dtype): round-to-nearest with the MSE scale fit,
        scales and zeros in `scale_dtype` (engine.quant.qparams.quantize_int4; llama.cpp's make_qkx2_quants). What
        quantization "int4" does to a dense weight on load, and `tokenmill quantize`'s round-to-nearest. Raises
        ValueError for a group size tinygemm lacks or a weight that is not 2-D."""
        return quantize_int4(weight, group_size, scale_dtype)

    @classmethod
    def for_weight(cls, weight: Int4Weight, dtype: torch.dtype, device: torch.device | str, *,
                   dequant_min_rows: int | None | str = "auto", layout: str = "dual") -> Int4GroupForm:
        return cls(dtype, device, group_size=weight.group_size, dequant_min_rows=dequant_min_rows, layout=layout)

    @staticmethod
    def held_shape(weight: Int4Weight) -> tuple[int, ...]:
        return weight.out_features, weight.in_features

    @staticmethod
    def held_fields(weight: Int4Weight) -> tuple:
        """At its padded width: the kernels hold Kp columns."""
        return weight.out_features * weight.padded_in_features, weight.group_size

    @staticmethod
    def to_float(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
        return weight.dequantize(dtype)

    def process_embedding(self, weight: Int4Weight) -> nn.Module:
        """Int4Embedding over the portable tensors (rows dequantized as they are looked up)."""
        return Int4Embedding(weight, self.dtype, self.device)

    def process_after_load(self, weight: Int4Weight, bias: torch.Tensor | None = None) -> nn.Module:
        """Int4Linear (packed for the device's kernels)."""
        module = Int4Linear(weight, self.dtype, self.device, self.dequant_min_rows, layout=self.layout)
        return with_bias(module, bias, self.dtype, self.device)


class Int8W8A8Form(HeldForm):
    """INT8 W8A8 (engine.quant.qparams.Int8Weight: int8 [N, K] and an fp32 scale per output channel; activations
    quantized per token at run time), served on the CPU by engine.quant.int8_linear.Int8Linear (oneDNN's int8
    GEMM). No CUDA kernel: a W8A8 folder there is held dense (dequantized exactly)."""

    name = "int8_w8a8"
    held_type = Int8Weight
    served_by = {"cpu": "engine.quant.int8_linear.Int8Linear"}
    tolerance = 5e-2  # 7-bit weights where the CPU lacks VNNI (engine.quant.int8_linear), 8-bit activations

    @staticmethod
    def from_float_model(model: ModelBase, calibration_ids: torch.Tensor) -> int:
        """The form's from-float step, for a whole filled model with plain linears, in place: projections fused
        (ModelBase.fuse_projections), smoothed by SmoothQuant from one forward over `calibration_ids` (int64 [n];
        engine.quant.smoothquant.smooth_model), then every decoder projection and expert quantized per output
        channel (engine.quant.int8_linear.quantize_model_int8). It stays in engine.quant, not engine.ptq: loading
        calls it ("int8" on load) and engine.ptq reads models through engine.loading, so a move would close a
        loading -> ptq -> loading package cycle. Returns the number of modules replaced. Raises ValueError as
        smooth_model and Int8Linear do."""
        model.fuse_projections()
        smooth_model(model, calibration_ids)
        return quantize_model_int8(model)

    def create(self, out_features: int, in_features: int) -> Int8Weight:
        return Int8Weight(torch.empty(out_features, in_features, dtype=torch.int8, device=META),
                          torch.empty(out_features, dtype=torch.float32, device=META))

    @staticmethod
    def held_shape(weight: Int8Weight) -> tuple[int, ...]:
        return tuple(weight.qweight.shape)

    @staticmethod
    def held_fields(weight: Int8Weight) -> tuple:
        return weight.qweight.numel(), None

    @staticmethod
    def to_float(weight: Int8Weight, dtype: torch.dtype) -> torch.Tensor:
        return weight.dequantize(dtype)

    def process_after_load(self, weight: Int8Weight, bias: torch.Tensor | None = None) -> nn.Module:
        """Int8Linear over the stored integers and scales (no second quantization). Raises ValueError off the CPU,
        and as Int8Linear."""
        self.kernel_for(self.device)
        return with_bias(Int8Linear(weight, self.dtype), bias, self.dtype, self.device)


class StackedInt4Form(HeldForm):
    """One projection of every expert of a mixture-of-experts layer as INT4 (engine.quant.stacked_int4.StackedInt4
    [E, N, Kp/2]). On CUDA with Triton the grouped W4A16 kernel serves a block's two projections together
    (engine.quant.experts.set_int4_experts); elsewhere each expert runs an Int4Linear over its slice
    (engine.quant.experts.expert_modules), which is what process_after_load builds.

    Args (beyond HeldForm's): num_experts and group_size (of `create`'s weight); layout: Int4Linear's (CUDA).
    """

    name = "stacked_int4"
    held_type = StackedInt4
    served_by = {"cpu": "engine.quant.experts.expert_modules",
                 "cuda": "engine.kernels.triton_moe_int4.fused_experts_int4"}
    tolerance = 0.15

    def __init__(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 num_experts: int = 1, group_size: int = 128, layout: str = "dual") -> None:
        super().__init__(dtype, device)
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts, self.group_size, self.layout = num_experts, group_size, layout

    def create(self, out_features: int, in_features: int) -> StackedInt4:
        one = Int4GroupForm(self.dtype, self.device, group_size=self.group_size).create(out_features, in_features)
        return StackedInt4(*(t.expand(self.num_experts, *t.shape) for t in (one.qweight, one.scales, one.zeros)),
                           in_features, self.group_size)

    @staticmethod
    def from_float(weights: torch.Tensor, group_size: int = 128,
                   scale_dtype: torch.dtype = torch.bfloat16) -> StackedInt4:
        """The held stacked INT4 weight of float expert weights [E, N, K]: each expert as Int4GroupForm.from_float
        quantizes it, one at a time (temporaries of one expert's size). Raises ValueError as that does."""
        return StackedInt4.from_weights([Int4GroupForm.from_float(w, group_size, scale_dtype) for w in weights])

    @classmethod
    def for_weight(cls, weight: StackedInt4, dtype: torch.dtype, device: torch.device | str, *,
                   dequant_min_rows: int | None | str = "auto", layout: str = "dual") -> StackedInt4Form:
        return cls(dtype, device, num_experts=weight.num_experts, group_size=weight.group_size, layout=layout)

    @staticmethod
    def held_shape(weight: StackedInt4) -> tuple[int, ...]:
        return weight.num_experts, weight.out_features, weight.in_features

    @staticmethod
    def held_fields(weight: StackedInt4) -> tuple:
        """All its experts' weights at their padded width, flagged as stacked (memory_fit counts one copy where the
        grouped kernel serves them)."""
        return weight.qweight.numel() * 2, weight.group_size, True, weight.scales.element_size()

    @staticmethod
    def to_float(weight: StackedInt4, dtype: torch.dtype) -> torch.Tensor:
        return weight.dequantize(dtype)

    def process_after_load(self, weight: StackedInt4, bias: torch.Tensor | None = None) -> nn.ModuleList:
        """One module per expert (expert_modules), expert e's bias row [N] of `bias` [E, N] added after it."""
        mods = expert_modules(weight, self.dtype, self.device, self.layout)
        return nn.ModuleList(mods if bias is None else
                             [with_bias(m, b, self.dtype, self.device) for m, b in zip(mods, bias, strict=True)])

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Expert e's rows through expert e: x [E, M, K] -> [E, M, N]."""
        return torch.stack([expert(rows) for expert, rows in zip(layer, x, strict=True)])


__all__ = ["HELD_FORMS", "DenseForm", "GGUFBlocksForm", "HeldForm", "Int4GroupForm", "Int8W8A8Form", "StackedInt4Form",
           "held_form_of"]

#: The one table of held forms: name -> class (each class's served_by: which module serves it on which device).
HELD_FORMS: dict[str, type[HeldForm]] = {
    form.name: form for form in (DenseForm, GGUFBlocksForm, Int4GroupForm, Int8W8A8Form, StackedInt4Form)}


def held_form_of(weight: object) -> type[HeldForm]:
    """The held form class whose held_type `weight` is (a plain tensor: DenseForm). Raises TypeError for anything
    else, naming the types HELD_FORMS holds."""
    for form in HELD_FORMS.values():
        if isinstance(weight, form.held_type):
            return form
    raise TypeError(f"{type(weight).__name__} is no held weight; HELD_FORMS holds "
                    f"{', '.join(f.held_type.__name__ for f in HELD_FORMS.values())}")

