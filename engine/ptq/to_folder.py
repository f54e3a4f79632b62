"""`tokenmill quantize`: a model (GGUF file or folder) written as a tokenmill folder, INT4 by round-to-nearest or
by GPTQ then end-to-end tuning (engine.ptq.quantize), or plain bf16. Reads the model through engine.loading (the
state readers, or the one loading entry point for GPTQ's calibration model) and writes the folder with
engine.loading.tokenmill_folder.save_folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from engine.config import ModelConfig
from engine.loading import gguf_file
from engine.loading.gguf_file import iter_gguf_state, read_gguf_config
from engine.loading.hf_folder import hf_quant_format, is_hf_folder, iter_hf_state, read_hf_config
from engine.loading.hf_quantized import check_quantization_mode
from engine.loading.model_files import resolve_model_path
from engine.loading.open_model import open_model
from engine.loading.quantized import read_model_config
from engine.loading.tokenmill_folder import read_folder, save_folder
from engine.ptq.calibration import calibration_batch
from engine.ptq.quantize import quantize_weights
from engine.quant.handler import Int4QuantHandler, dequantize_state_dict
from engine.quant.state import LM_HEAD, QuantizedState
from engine.text.tokenizer import Tokenizer


def check_experts_quantization(cfg: ModelConfig, method: str) -> None:
    """Raises ValueError when `tokenmill quantize --method gptq` would have to calibrate a mixture-of-experts
    model's experts (engine.layers.moe): GPTQ per expert (a Hessian per expert from the tokens routed to it) is not
    implemented; round-to-nearest (--method rtn, the default) quantizes them, as quantization int4 does on load."""
    if cfg.num_experts and method == "gptq":
        raise ValueError(f"tokenmill quantize --method gptq of a mixture-of-experts model ({cfg.architecture}, "
                         f"{cfg.num_experts} experts) is not implemented; use --method rtn, or run the model with "
                         "quantization int4 (each expert quantized on load)")


QUANTIZE_METHODS = ("rtn", "gptq")


def quantize_to_folder(model: str | None, out_dir: str, bits: int = 4, group_size: int = 128,
                       include_embedding: bool = True, *, method: str = "rtn",
                       calibration: Sequence[Sequence[str]] | None = None, calibration_samples: int = 128,
                       calibration_seq_len: int = 256, act_order: bool = True, damp: float = 0.01,
                       tune_epochs: float = 1.0, on_layer: Callable[[int, float], None] | None = None,
                       on_tune_step: Callable[[int, int, float], None] | None = None) -> dict[str, Any]:
    """Write `model` (GGUF file or folder) as a tokenmill folder: INT4 (bits=4, group-wise at group_size, the
    embedding too unless include_embedding=False) or plain bf16 (bits=16). Returns the folder's JSON config.

    method "rtn": round-to-nearest with the MSE scale fit, weights quantized one at a time from fp32, so peak memory
    is about one fp32 tensor plus the output. method "gptq" (engine.ptq.gptq): the model is loaded in fp32 on the
    CPU and its decoder projections are quantized layer by layer on `calibration_samples` sequences of
    `calibration_seq_len` tokens, split evenly over the `calibration` sources (each a list of texts, joined by blank
    lines; engine.ptq.calibration.calibration_batch), with `act_order` and dampening `damp`, then every group's
    scale and zero is tuned end to end for `tune_epochs` passes over the same sequences (engine.ptq.tune; 0 =
    off) (defaults: the best measured on SmolLM2-135M, bench/README.md); the embedding (and a tied LM head) stays
    round-to-nearest.
    Use calibration text that is not your evaluation text. on_layer / on_tune_step: progress callbacks.
    Raises ValueError for bits other than 4 or 16, a bad group size or method, gptq without calibration text, an
    already quantized HF folder at bits 4 (check_quantization_mode: never quantized twice), or gptq of a
    mixture-of-experts model (check_experts_quantization; rtn quantizes its experts one at a time)."""
    if bits not in (4, 16):
        raise ValueError(f"bits must be 4 (INT4) or 16 (bf16), got {bits}")
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"method must be one of {QUANTIZE_METHODS}, got {method!r}")
    path = resolve_model_path(model)
    fmt = hf_quant_format(path) if bits == 4 and is_hf_folder(path) else None
    if fmt is not None:
        check_quantization_mode(fmt, "int4", path)
    handler = Int4QuantHandler(group_size, include_embedding) if bits == 4 else None
    if bits == 4 and method == "gptq":
        if not calibration or not any(calibration):
            raise ValueError("method 'gptq' needs calibration text (e.g. --calibration '../shared/data/"
                             "gsm8k_test.parquet#question,answer')")
        return _gptq_to_folder(path, out_dir, group_size, include_embedding, calibration, calibration_samples,
                               calibration_seq_len, act_order, damp, tune_epochs, on_layer, on_tune_step)
    if is_hf_folder(path):
        cfg = read_hf_config(path)
        items: Iterator[tuple[str, Any]] = iter_hf_state(path, cfg, torch.float32)
    elif os.path.isdir(path):
        cfg, stored, _ = read_folder(path)
        items = iter(dequantize_state_dict(stored, torch.float32).items())
    else:
        reader = gguf_file.open_gguf(path)  # looked up per call: tests patch the one way to open a GGUF
        cfg = read_gguf_config(reader)
        items = iter_gguf_state(reader, cfg, native_int4=False)
    state: QuantizedState = {}
    for name, w in items:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        state.update(handler.quantize_state_dict({name: w}) if handler else {name: w.to(torch.bfloat16)})
    return save_folder(out_dir, cfg, state, Tokenizer.from_model_path(path).hf_tokenizer, bits=bits,
                       group_size=group_size if bits == 4 else None, source=os.path.basename(path))


def _gptq_to_folder(path: str, out_dir: str, group_size: int, include_embedding: bool,
                    sources: Sequence[Sequence[str]], samples: int, seq_len: int, act_order: bool, damp: float,
                    tune_epochs: float, on_layer: Callable[[int, float], None] | None,
                    on_tune_step: Callable[[int, int, float], None] | None) -> dict[str, Any]:
    check_experts_quantization(read_model_config(path), "gptq")
    loaded = open_model(path, torch.float32, torch.device("cpu"), quantization="none")
    cfg, llama = loaded.config, loaded.model
    calibration = calibration_batch(loaded.tokenizer, sources, samples, seq_len)
    state: QuantizedState = dict(quantize_weights(llama, group_size, include_embedding, calibration=calibration,
                                                  act_order=act_order, damp=damp, tune_epochs=tune_epochs,
                                                  on_layer=on_layer, on_tune_step=on_tune_step))
    for name, w in llama.state_dict().items():  # the norms (tuned ones included) and a kept embedding
        if name.removesuffix(".weight") not in state and not (cfg.tie_word_embeddings and name == f"{LM_HEAD}.weight"):
            state[name] = w
    return save_folder(out_dir, cfg, state, loaded.tokenizer.hf_tokenizer, bits=4, group_size=group_size,
                       source=os.path.basename(path), method="gptq")
