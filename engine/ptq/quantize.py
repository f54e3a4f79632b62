"""The INT4 driver: quantize a filled model's weights by round-to-nearest, or by GPTQ (engine.ptq.gptq) and then
the end-to-end tuning of the group scales and zeros (engine.ptq.tune), and swap Int4Linear / Int4Embedding in.

The one module that knows the order of the passes: GPTQ and the tuning know nothing of each other, and the handler
(engine.quant.handler) knows neither.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from engine.model.base import ModelBase
from engine.ptq.gptq import gptq_quantize_model
from engine.ptq.tune import tune_group_qparams
from engine.quant.experts import quantize_experts
from engine.quant.handler import Int4QuantHandler
from engine.quant.int4_linear import Int4Embedding, Int4Linear
from engine.quant.qparams import Int4Weight, quantize_int4
from engine.quant.state import EMBEDDING, LM_HEAD, set_module


def quantize_weights(model: ModelBase, group_size: int = 128, include_embedding: bool = False, *,
                     calibration: torch.Tensor | None = None, act_order: bool = False, damp: float = 0.01,
                     refit: bool = True, tune_epochs: float = 0.0,
                     on_layer: Callable[[int, float], None] | None = None,
                     on_tune_step: Callable[[int, int, float], None] | None = None) -> dict[str, Int4Weight]:
    """INT4 weights for a filled model: every decoder projection and an untied LM head, plus the embedding when
    `include_embedding` (a tied LM head then reads it). The one driver behind quantize_model (modules swapped in
    place) and `tokenmill quantize --method gptq` (engine.loading.quantized, weights written to a folder).

    Args:
        model: ModelBase with plain nn.Linear / nn.Embedding weights; fp32 when calibrating.
        group_size: input features per scale/zero group (32, 64, 128 or 256).
        calibration: None = round-to-nearest with the MSE scale fit (qparams.quantize_int4); int64 [S, L] token
            ids (engine.ptq.calibration.calibration_batch) = GPTQ for the decoder projections (engine.ptq.gptq),
            run after the embedding is rounded so the calibration sees the INT4 embedding; then, for
            tune_epochs > 0, every group's scale and zero (and every RMSNorm gain) tuned end to end against a copy
            of the model as passed in (engine.ptq.tune). The embedding and an untied LM head always use
            round-to-nearest.
        act_order, damp, refit, on_layer: as engine.ptq.gptq.gptq_quantize_model.
        tune_epochs: passes of the end-to-end tuning over the calibration batch (engine.ptq.tune; 0 = off).
        on_tune_step: tuning progress callback (step, steps, KL in nats per token).
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
        calibrated = gptq_quantize_model(model, calibration, group_size, act_order=act_order, damp=damp,
                                         refit=refit, on_layer=on_layer)
        if teacher is not None:
            calibrated = tune_group_qparams(model, teacher, calibrated, calibration, epochs=tune_epochs,
                                            on_step=on_tune_step)
            del teacher
        weights.update(calibrated)
    for name, module in model.named_modules():
        tied = name == LM_HEAD and model.config.tie_word_embeddings  # follows the embedding, never on its own
        if isinstance(module, nn.Linear) and handler.wants(f"{name}.weight") and not tied and name not in weights:
            weights[name] = quantize_int4(module.weight.detach(), group_size)
    return weights


def quantize_model(model: ModelBase, group_size: int = 128, include_embedding: bool = False,
                   dequant_min_rows: int | None | str = "auto", *, calibration: torch.Tensor | None = None,
                   act_order: bool = False, damp: float = 0.01, refit: bool = True, tune_epochs: float = 0.0,
                   on_layer: Callable[[int, float], None] | None = None,
                   on_tune_step: Callable[[int, int, float], None] | None = None) -> ModelBase:
    """Quantize a filled model in place: each projection (and the embedding when asked; a tied LM head with it)
    becomes an Int4Linear / Int4Embedding on the model's device with its dtype, the weights chosen by
    quantize_weights (round-to-nearest, or GPTQ + tuning with `calibration`; pass an fp32 model then), and a
    mixture-of-experts model's experts INT4 by round-to-nearest (engine.quant.experts.quantize_experts: on CUDA the
    grouped INT4 kernel's stacks). Returns the model. dequant_min_rows: Int4Linear's kernel switch. Raises ValueError
    as quantize_weights."""
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
    quantize_experts(model, group_size)
    return model
