"""INT4 handler (layer 2 of 3, after gpt-fast's WeightOnlyInt4QuantHandler): turns a state dict into INT4 weights
and a model's modules into Int4Linear / Int4Embedding.

A quantized state dict maps a *module* name (e.g. "layers.0.self_attn.q_proj") to an Int4Weight and every other
parameter name (e.g. "norm.weight") to a plain tensor. On disk each Int4Weight X becomes three tensors, X.qweight,
X.scales and X.zeros (engine.quant.folder).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model import LlamaModel
from engine.quant.int4_linear import Int4Embedding, Int4Linear
from engine.quant.qparams import Int4Weight, check_group_size, quantize_int4

LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = ("qkv_proj", "gate_up_proj")  # the serving layout (LlamaModel.fuse_projections)
EMBEDDING = "embed_tokens"
LM_HEAD = "lm_head"

QuantizedState = dict[str, "torch.Tensor | Int4Weight"]


def is_linear_weight(name: str) -> bool:
    """True for the weight of a decoder projection (fused or not) or the LM head (HF names without "model.")."""
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and (module.rsplit(".", 1)[-1] in LINEAR_MODULES + FUSED_MODULES
                                         or module == LM_HEAD)


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
        """Whether parameter `name` gets quantized."""
        return is_linear_weight(name) or (self.include_embedding and name == f"{EMBEDDING}.weight")

    def quantize_state_dict(self, state: dict[str, torch.Tensor | Int4Weight]) -> QuantizedState:
        """A new state dict with every wanted weight as an Int4Weight under its module name; weights that already
        are Int4Weight (e.g. GGUF Q4 loaded natively) are kept as they are. Tensors are not copied."""
        out: QuantizedState = {}
        for name, t in state.items():
            if isinstance(t, Int4Weight):
                out[name] = t
            elif self.wants(name):
                out[name.removesuffix(".weight")] = quantize_int4(t, self.group_size, self.scale_dtype)
            else:
                out[name] = t
        return out


def dequantize_state_dict(state: QuantizedState, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Plain state dict (HF parameter names) with every Int4Weight dequantized to `dtype`."""
    return {(f"{k}.weight" if isinstance(v, Int4Weight) else k):
            (v.dequantize(dtype) if isinstance(v, Int4Weight) else v) for k, v in state.items()}


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted `name` (e.g. "layers.3.mlp.down_proj") of `model` by `module`."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def build_model(cfg: ModelConfig, state: QuantizedState, dtype: torch.dtype, device: torch.device,
                max_positions: int | None = None, dequant_min_rows: int | None | str = "auto") -> LlamaModel:
    """A LlamaModel on `device` from a (possibly partly) quantized state dict.

    Built on the meta device: INT4 modules replace their nn.Linear / nn.Embedding, plain tensors are cast to
    `dtype` and assigned, so no weight exists twice. A tied LM head follows the embedding: INT4 when the
    embedding is INT4 (an Int4Linear over the same portable tensors), else the shared nn.Parameter.
    Raises ValueError when a tensor is missing or an INT4 weight does not fit its module's shape.
    """
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
    state = dict(state)
    if cfg.tie_word_embeddings:
        state.pop(f"{LM_HEAD}.weight", None)
        state.pop(LM_HEAD, None)
        if isinstance(state.get(EMBEDDING), Int4Weight):
            state[LM_HEAD] = state[EMBEDDING]
    for name, w in list(state.items()):
        if not isinstance(w, Int4Weight):
            continue
        old = model.get_submodule(name)
        shape = (old.num_embeddings, old.embedding_dim) if isinstance(old, nn.Embedding) else (
            old.out_features, old.in_features)
        if (w.out_features, w.in_features) != shape:
            raise ValueError(f"INT4 weight {name} is [{w.out_features}, {w.in_features}], the model wants {shape}: "
                             "the model file does not match its config")
        new = Int4Embedding(w, dtype, device) if isinstance(old, nn.Embedding) else Int4Linear(
            w, dtype, device, dequant_min_rows)
        set_module(model, name, new)
        del state[name]
    plain = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard(f"{LM_HEAD}.weight")
    missing = expected - set(plain)
    if missing:
        raise ValueError(f"model file lacks tensors {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)")
    model.load_state_dict(plain, strict=False, assign=True)
    if cfg.tie_word_embeddings and isinstance(model.embed_tokens, nn.Embedding):
        model.tie_weights()
    model.materialize_rotary(device)
    return model.eval()


def quantize_weights(model: LlamaModel, group_size: int = 128, include_embedding: bool = False, *,
                     calibration: torch.Tensor | None = None, act_order: bool = False, damp: float = 0.01,
                     refit: bool = True, tune_epochs: float = 0.0,
                     on_layer: Callable[[int, float], None] | None = None,
                     on_tune_step: Callable[[int, int, float], None] | None = None) -> dict[str, Int4Weight]:
    """INT4 weights for a filled model: every decoder projection and an untied LM head, plus the embedding when
    `include_embedding` (a tied LM head then reads it). The one driver behind quantize_model (modules swapped in
    place) and `tokenmill quantize --method gptq` (engine.quant.loading, weights written to a folder).

    Args:
        model: LlamaModel with plain nn.Linear / nn.Embedding weights; fp32 when calibrating.
        group_size: input features per scale/zero group (32, 64, 128 or 256).
        calibration: None = round-to-nearest with the MSE scale fit (qparams.quantize_int4); int64 [S, L] token
            ids (engine.quant.calibration.calibration_batch) = GPTQ for the decoder projections (engine.quant.gptq),
            run after the embedding is rounded so the calibration sees the INT4 embedding; then, for
            tune_epochs > 0, every group's scale and zero (and every RMSNorm gain) tuned end to end against a copy
            of the model as passed in (engine.quant.tune). The embedding and an untied LM head always use
            round-to-nearest.
        act_order, damp, refit, tune_epochs, on_layer, on_tune_step: as engine.quant.gptq.gptq_quantize_model.
    Returns {module name: Int4Weight} with bf16 scales and zeros. With calibration the model is modified in place:
    the rounded embedding and each calibrated projection hold their dequantized INT4 values (plain modules), and
    with tuning the RMSNorm gains are the tuned ones, so take the model's other tensors from it afterwards.
    Raises ValueError for an unsupported group size, or calibration on a model that is not fp32.
    """
    handler = Int4QuantHandler(group_size, include_embedding)  # checks the group size
    weights: dict[str, Int4Weight] = {}
    teacher = copy.deepcopy(model) if calibration is not None and tune_epochs > 0 else None
    if include_embedding:  # first, so the calibration forwards see the INT4 embedding
        emb = model.embed_tokens.weight
        weights[EMBEDDING] = quantize_int4(emb.detach(), group_size)
        if calibration is not None:
            emb.data = weights[EMBEDDING].dequantize(emb.dtype).to(emb.device)
    if calibration is not None:
        from engine.quant.gptq import gptq_quantize_model

        weights.update(gptq_quantize_model(model, calibration, group_size, act_order=act_order, damp=damp,
                                           refit=refit, tune_epochs=tune_epochs, teacher=teacher,
                                           on_layer=on_layer, on_tune_step=on_tune_step))
        del teacher
    for name, module in model.named_modules():
        tied = name == LM_HEAD and model.config.tie_word_embeddings  # follows the embedding, never on its own
        if isinstance(module, nn.Linear) and handler.wants(f"{name}.weight") and not tied and name not in weights:
            weights[name] = quantize_int4(module.weight.detach(), group_size)
    return weights


def quantize_model(model: LlamaModel, group_size: int = 128, include_embedding: bool = False,
                   dequant_min_rows: int | None | str = "auto", *, calibration: torch.Tensor | None = None,
                   act_order: bool = False, damp: float = 0.01, refit: bool = True, tune_epochs: float = 0.0,
                   on_layer: Callable[[int, float], None] | None = None,
                   on_tune_step: Callable[[int, int, float], None] | None = None) -> LlamaModel:
    """Quantize a filled model in place: each projection (and the embedding when asked; a tied LM head with it)
    becomes an Int4Linear / Int4Embedding on the model's device with its dtype, the weights chosen by
    quantize_weights (round-to-nearest, or GPTQ + tuning with `calibration`; pass an fp32 model then). Returns the
    model. dequant_min_rows: Int4Linear's kernel switch. Raises ValueError as quantize_weights."""
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    weights = quantize_weights(model, group_size, include_embedding, calibration=calibration, act_order=act_order,
                               damp=damp, refit=refit, tune_epochs=tune_epochs, on_layer=on_layer,
                               on_tune_step=on_tune_step)
    if EMBEDDING in weights:
        model.embed_tokens = Int4Embedding(weights[EMBEDDING], dtype, device)
        if model.config.tie_word_embeddings:
            weights[LM_HEAD] = weights[EMBEDDING]
    for name, w in weights.items():
        if name != EMBEDDING:
            set_module(model, name, Int4Linear(w, dtype, device, dequant_min_rows))
    return model
