"""tokenmill model folders: safetensors weights, a small JSON config and the tokenizer, loadable with --model DIR.

Layout:
    tokenmill_model.json   {"format": "tokenmill", "format_version": 2, "model_config": {...ModelConfig...},
                            "quantization": {"bits": 4, "group_size": G, "scheme": ..., "modules": {...}} | {"bits":
                            16}, "source": "<file it came from>"}
    model.safetensors      plain tensors by HF name (bf16); each INT4 module X as X.qweight (uint8 [N, Kp/2]),
                            X.scales and X.zeros (bf16 [N, Kp/G]) in the portable format of engine.quant.qparams;
                            a mixture-of-experts block's projection stacked over its E experts (uint8 [E, N, Kp/2],
                            bf16 [E, N, Kp/G]: engine.quant.stacked_int4.StackedInt4)
    tokenizer.json, tokenizer_config.json, chat_template.jinja   (HF save_pretrained)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.loading.model_files import TOKENMILL_CONFIG_FILE
from engine.quant.qparams import Int4Weight
from engine.quant.stacked_int4 import StackedInt4
from engine.quant.state import QuantizedState

CONFIG_FILE = TOKENMILL_CONFIG_FILE
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 2  # 2: model_config gained architecture, qkv_bias, qk_norm, rope_scaling, eos_token_ids, ...
_PARTS = ("qweight", "scales", "zeros")


def is_model_folder(path: str) -> bool:
    """True when `path` is a folder written by `save_folder` (it holds tokenmill_model.json)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_FILE))


def save_folder(out_dir: str, cfg: ModelConfig, state: QuantizedState, hf_tokenizer: Any, *, bits: int,
                group_size: int | None, source: str, method: str = "rtn") -> dict[str, Any]:
    """Write a model folder; returns the JSON config written. Plain tensors are stored as bf16 (fp32 for 1-D
    norm weights, which are tiny). `method` (how the INT4 codes were chosen: "rtn" round-to-nearest, "gptq") is
    recorded in the config only. Raises FileExistsError when out_dir holds a file other than ours."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ours = {CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "special_tokens_map.json"}
    foreign = [p.name for p in out.iterdir() if p.name not in ours]
    if foreign:
        raise FileExistsError(f"{out_dir} already holds {foreign[:3]}; pick an empty or new --output folder")
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, int] = {}
    for name, v in state.items():
        if isinstance(v, Int4Weight | StackedInt4):
            if v.in_perm is not None:
                raise ValueError(f"{name}: INT4 weights with permuted input features (act-order) have no place in a "
                                 "tokenmill folder; run the quantized checkpoint itself")
            modules[name] = v.in_features
            tensors[f"{name}.qweight"] = v.qweight.contiguous()
            tensors[f"{name}.scales"] = v.scales.to(torch.bfloat16).contiguous()
            tensors[f"{name}.zeros"] = v.zeros.to(torch.bfloat16).contiguous()
        else:
            tensors[name] = v.to(torch.float32 if v.dim() == 1 else torch.bfloat16).contiguous()
    quant: dict[str, Any] = {"bits": bits}
    if bits == 4:
        quant.update(group_size=group_size, scheme="asymmetric, w = (q - 8) * scale + zero", method=method,
                     layout="uint8 [N, Kp/2], element 2j in the high nibble; scales/zeros bf16 [N, Kp/G]",
                     modules=modules)
    meta = {"format": "tokenmill", "format_version": FORMAT_VERSION, "model_config": dataclasses.asdict(cfg),
            "quantization": quant, "source": source}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(str(out))
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")  # written last: marks the folder complete
    return meta


def read_folder_config(path: str) -> ModelConfig:
    """The ModelConfig of a model folder (its JSON config only). Raises as read_folder."""
    return _read_meta(path)[0]


def _read_meta(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    if not is_model_folder(path):
        raise FileNotFoundError(f"{path} is not a tokenmill model folder (no {CONFIG_FILE}); write one with "
                                "`tokenmill quantize --output DIR` or pass a GGUF file")
    meta = json.loads(Path(path, CONFIG_FILE).read_text())
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path} has format version {meta['format_version']}; this tokenmill reads up to "
                         f"{FORMAT_VERSION}: upgrade tokenmill")
    return ModelConfig.from_dict(meta["model_config"]), meta


def read_folder(path: str) -> tuple[ModelConfig, QuantizedState, dict[str, Any]]:
    """(ModelConfig, state with Int4Weight per INT4 module (StackedInt4 for stacked experts), the JSON config) of a
    model folder, on the CPU.

    Raises FileNotFoundError when the folder lacks tokenmill_model.json, ValueError for a newer format version
    or a broken INT4 module.
    """
    from safetensors.torch import load_file

    cfg, meta = _read_meta(path)
    tensors = load_file(str(Path(path, WEIGHTS_FILE)))
    quant = meta["quantization"]
    state: QuantizedState = {}
    for name, in_features in quant.get("modules", {}).items():
        parts = [tensors.pop(f"{name}.{p}") for p in _PARTS]
        kind = StackedInt4 if parts[0].dim() == 3 else Int4Weight
        state[name] = kind(*parts, in_features=in_features, group_size=quant["group_size"])
    state.update(tensors)
    return cfg, state, meta


def folder_bytes(path: str) -> int:
    """Total size in bytes of the files in a folder (not recursive)."""
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())
