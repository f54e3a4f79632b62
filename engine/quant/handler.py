"""INT4 handler (layer 2 of 3, after gpt-fast's WeightOnlyInt4QuantHandler): turns a state dict into INT4 weights
and a quantized state dict into a model of Int4Linear / Int4Embedding modules.

The state dict conventions (module names, QuantizedState) are engine.quant.state's; the driver that quantizes a
filled model (round-to-nearest, or GPTQ then tuning) is engine.ptq.quantize.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model import registry
from engine.model.base import ModelBase
from engine.model.fill import fill_model
from engine.model.tensor_names import is_expert_weight
from engine.quant.experts import pop_int4_experts, set_int4_experts
from engine.quant.forms import DenseForm, Int4GroupForm, StackedInt4Form, held_form_of
from engine.quant.qparams import Int4Weight, check_group_size
from engine.quant.state import EMBEDDING, LM_HEAD, QuantizedState, is_linear_weight, set_module


class Int4QuantHandler:
    """Group-wise INT4 (W4A16) quantization of a Llama state dict.

    Args:
        group_size: input features per scale/zero group (32, 64, 128 or 256).
        include_embedding: also quantize `embed_tokens` (then a tied LM head reads the same INT4 tensor). Without
            it a tied SmolLM2-135M keeps 28M of its 134M weights in 16 bits and its folder is 0.42x of bf16.
        scale_dtype: dtype of scales and zeros (bf16, the portable format).
    Raises ValueError for an unsupported group size.
    """

    def __init__(self, group_size: int = 128, include_embedding: bool = True,
                 scale_dtype: torch.dtype = torch.bfloat16) -> None:
        check_group_size(group_size)
        self.group_size = group_size
        self.include_embedding = include_embedding
        self.scale_dtype = scale_dtype

    def wants(self, name: str) -> bool:
        """Whether parameter `name` gets quantized: a projection, a mixture-of-experts block's stacked expert
        projection (quantized one expert at a time into a StackedInt4; its router stays as it is), the embedding
        when asked."""
        return (is_linear_weight(name) or is_expert_weight(name)
                or (self.include_embedding and name == f"{EMBEDDING}.weight"))

    def quantize_state_dict(self, state: dict[str, torch.Tensor | Int4Weight]) -> QuantizedState:
        """A new state dict with every wanted weight as an Int4Weight under its module name (stacked experts
        [E, out, in] as a StackedInt4, one expert at a time: temporaries of one expert's size); weights that already
        are INT4 (e.g. GGUF Q4 loaded natively) are kept as they are. Tensors are not copied."""
        out: QuantizedState = {}
        for name, t in state.items():
            if held_form_of(t) is not DenseForm:
                out[name] = t
            elif self.wants(name) and t.dim() == 3:
                out[name.removesuffix(".weight")] = StackedInt4Form.from_float(t, self.group_size, self.scale_dtype)
            elif self.wants(name):
                out[name.removesuffix(".weight")] = Int4GroupForm.from_float(t, self.group_size, self.scale_dtype)
            else:
                out[name] = t
        return out


def dequantize_state_dict(state: QuantizedState, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain state dict (HF parameter names): every held weight that is not a plain tensor (an Int4Weight, a
    StackedInt4 [E, N, K], ...) dequantized to `dtype` by its held form (HeldForm.to_float) under its parameter's
    name; plain tensors as they are."""
    out = {}
    for k, v in state.items():
        form = held_form_of(v)
        out[k if form is DenseForm else f"{k}.weight"] = form.to_float(v, dtype)
    return out


def held_tensors(cfg: ModelConfig, state: QuantizedState) -> list[tuple]:
    """What engine.worker.memory_fit.weight_bytes takes (HeldWeight's fields) of each weight build_model makes of
    `state`, as its held form counts it (HeldForm.held_fields: INT4 ones at their padded width, a StackedInt4 as all
    its experts' weights with its bytes per scale as stored): a tied LM head left out (it shares the embedding's
    parameter) unless the embedding is INT4 (then the head is an Int4Linear with its own packed copies)."""
    return [held_form_of(w).held_fields(w) for w in _tied(cfg, state).values()]


def _tied(cfg: ModelConfig, state: QuantizedState) -> QuantizedState:
    """A copy of `state` as build_model fills the model: for tied embeddings, no LM head of its own, except an INT4
    embedding's (the same Int4Weight under LM_HEAD)."""
    state = dict(state)
    if cfg.tie_word_embeddings:
        state.pop(f"{LM_HEAD}.weight", None)
        state.pop(LM_HEAD, None)
        if isinstance(state.get(EMBEDDING), Int4Weight):
            state[LM_HEAD] = state[EMBEDDING]
    return state


def build_model(cfg: ModelConfig, state: QuantizedState, dtype: torch.dtype, device: torch.device,
                max_positions: int | None = None, dequant_min_rows: int | None | str = "auto", *,
                int4_layout: str = "dual") -> ModelBase:
    """A model (engine.model.registry.build_model) on `device` from a (possibly partly) quantized state dict.

    Built on the meta device: each held weight that is not a plain tensor (Int4Weight; a W8A8 checkpoint's stored
    Int8Weight, CPU only) replaces its nn.Linear / nn.Embedding by its held form's module (engine.quant.forms:
    HeldForm.for_weight, then process_after_load or process_embedding), plain tensors are cast to `dtype` and
    assigned, so no weight exists twice. A tied LM head follows the embedding: INT4 when the
    embedding is INT4 (an Int4Linear over the same portable tensors), else the shared nn.Parameter. A mixture-of-
    experts block with StackedInt4 experts gets one module per expert (engine.quant.experts). int4_layout: the
    Int4Linear modules' layout on CUDA ("dual" or "single": engine.quant.int4_linear, engine.quant.experts).
    Raises ValueError when a tensor is missing, a quantized weight does not fit its module's shape, or its held form
    has no kernel on `device` (HeldForm.kernel_for) or serves no embedding.
    """
    with torch.device("meta"):
        model = registry.build_model(cfg, max_positions)
    state = _tied(cfg, state)
    experts = pop_int4_experts(model, state)
    for name, w in list(state.items()):
        form = held_form_of(w)
        if form is DenseForm:
            continue
        old = model.get_submodule(name)
        embedding = isinstance(old, nn.Embedding)
        shape = (old.num_embeddings, old.embedding_dim) if embedding else (old.out_features, old.in_features)
        if form.held_shape(w) != shape:
            raise ValueError(f"quantized weight {name} is {list(form.held_shape(w))}, the model wants {shape}: the "
                             "model file does not match its config")
        held = form.for_weight(w, dtype, device, dequant_min_rows=dequant_min_rows, layout=int4_layout)
        # a replaced projection's bias comes along (set_module: AddBias)
        set_module(model, name, held.process_embedding(w) if embedding else held.process_after_load(w))
        del state[name]
    fill_model(model, state, dtype, device)
    set_int4_experts(model, experts, dtype, device, int4_layout)
    return model
