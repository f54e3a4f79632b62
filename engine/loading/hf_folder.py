"""Hugging Face model folders (config.json, generation_config.json, safetensors weights, sharded with an index):
their config through the architecture registry and their tensors, one at a time, under our parameter names.

Format: https://huggingface.co/docs/safetensors (read with the `safetensors` package's safe_open).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from engine.loading.gpt_oss_tensors import StackedExpertReader, stacked_expert_index
from engine.loading.hf_quantized import (
    KeepStored,
    QuantFormat,
    QuantReport,
    iter_quantized_state,
    param_names,
    read_quant_format,
    refuse_unmarked_quantized,
    stack_experts,
)
from engine.loading.model_files import HF_CONFIG_FILE, TOKENMILL_CONFIG_FILE
from engine.model.architectures import get_architecture
from engine.model.hf_config import config_from_hf
from engine.model.registry import entry_of
from engine.model.tensor_names import LM_HEAD, check_tensor_names, split_fused

if TYPE_CHECKING:
    import torch

_HF_INDEX_FILE = "model.safetensors.index.json"


def is_hf_folder(path: str) -> bool:
    """True when `path` is a Hugging Face model folder (config.json beside safetensors weights), not a tokenmill
    folder (engine.loading.tokenmill_folder)."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, HF_CONFIG_FILE))
            and not os.path.isfile(os.path.join(path, TOKENMILL_CONFIG_FILE)))


def read_hf_config(path: str) -> ModelConfig:
    """ModelConfig of the HF folder at `path`: config.json through its architecture's registry entry, plus
    generation_config.json's stop tokens (engine.model.hf_config.config_from_hf). A causal decoder's folder with
    sentence-transformers' modules.json is an embedding model too (ModelConfig.pooling_files), without an LM head
    when its weights hold none and its embeddings are untied (ModelConfig.lm_head: sentence-transformers saves the
    trunk alone, whatever config.json's `architectures` says). Raises ValueError as config_from_hf does."""
    config = json.loads(Path(path, HF_CONFIG_FILE).read_text())
    gen_path = Path(path, "generation_config.json")
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    cfg = config_from_hf(config, generation)
    if cfg.labels or not Path(path, "modules.json").is_file() or "generate" not in entry_of(cfg).tasks:
        return cfg
    return dataclasses.replace(cfg, pooling_files=True,
                               lm_head=cfg.tie_word_embeddings or f"{LM_HEAD}.weight" in _weight_keys(path))


def _weight_keys(path: str) -> set[str]:
    """The tensor names of an HF folder's safetensors files (their index's, or their headers')."""
    from safetensors import safe_open

    index = Path(path, _HF_INDEX_FILE)
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    keys: set[str] = set()
    for file in hf_weight_files(path):
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


def hf_weight_files(path: str) -> list[str]:
    """The safetensors files of an HF folder: those model.safetensors.index.json names (sharded), else every
    *.safetensors. Raises ValueError when there are none (e.g. only pytorch_model.bin, which we do not read)."""
    index = Path(path, _HF_INDEX_FILE)
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not Path(path, f).is_file()]
        if missing:
            raise ValueError(f"{path}: {_HF_INDEX_FILE} names {missing[:3]}, which are missing; copy the whole folder")
        return [str(Path(path, f)) for f in files]
    files = sorted(str(p) for p in Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights; tokenmill reads safetensors (convert .bin files with "
                         "transformers' save_pretrained(safe_serialization=True))")
    return files


_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def hf_quant_format(path: str) -> QuantFormat | None:
    """The checked quantization_config of an HF folder (engine.loading.hf_quantized), None when unquantized.
    Raises ValueError (one line) for a method or layout tokenmill does not read."""
    return read_quant_format(json.loads(Path(path, HF_CONFIG_FILE).read_text()), path)


def _hf_param_name(key: str, renames: tuple[tuple[str, str], ...] = ()) -> tuple[str, int | None]:
    """(our parameter name, expert index or None) of an HF checkpoint key: "model.layers.0..." -> "layers.0...",
    "lm_head.weight" kept, the architecture's renames applied (Architecture.hf_renames), and one expert's weight
    ("layers.0.mlp.experts.5.up_proj.weight") named by the stacked parameter it is row 5 of
    ("layers.0.mlp.experts.up_proj.weight")."""
    name = key.removeprefix("model.")
    for old, new in renames:
        name = name.replace(old, new)
    m = _EXPERT_KEY.search(name)
    if m is None:
        return name, None
    return f"{name[:m.start()]}.experts.{name[m.end():]}", int(m.group(1))


def _quantized_name(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    """Our name of a quantized HF folder's checkpoint key or quantized module (e.g.
    "model.layers.0.block_sparse_moe.experts.3.w1" -> "layers.0.mlp.experts.3.gate_proj"): the "model." prefix
    dropped and the architecture's renames applied (to a module name as to its ".weight"), an expert's index kept
    (stack_experts stacks them)."""
    name = key.removeprefix("model.")
    plain, module = name, f"{name}.weight"
    for old, new in renames:
        plain, module = plain.replace(old, new), module.replace(old, new)
    module = module.removesuffix(".weight")
    return module if module != plain else plain


def hf_tensor_index(path: str, cfg: ModelConfig) -> dict[str, tuple[tuple[str, str], ...]]:
    """{our parameter name: ((file, checkpoint key), ...)} of an HF folder, from the safetensors headers only, checked
    against `cfg`'s architecture: one key per parameter, or for a mixture-of-experts layer's stacked expert weight
    the num_experts keys of experts 0, 1, ... in order. A quantized folder's layers count as "<module>.weight", their
    file and key those of the layer's first tensor; a family with fused projections (Phi-3) keeps its fused names
    (qkv_proj, gate_up_proj). Raises ValueError naming an unknown or missing tensor (check_tensor_names) or expert, an
    unsupported quantization_config, GPTQ-style tensors without one, or a quantized gpt-oss folder other than its
    MXFP4 one."""
    from safetensors import safe_open

    fmt = hf_quant_format(path)
    keys: dict[str, str] = {}
    for file in hf_weight_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if not key.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed from cfg
                    keys[key] = file
    arch = get_architecture(cfg.architecture)
    keys = {k: f for k, f in keys.items() if not k.startswith(arch.hf_unused)} if arch.hf_unused else keys
    if fmt is None:
        refuse_unmarked_quantized(keys, path)
    elif arch.hf_stacked_experts:
        raise ValueError(f"{path}: a {fmt.describe()} {cfg.architecture} folder is not read (its stacked experts "
                         "are read from the MXFP4 or unquantized checkpoint only); use one of those")
    plain: dict[str, tuple[str, str]] = {}
    experts: dict[str, dict[int, tuple[str, str]]] = {}
    for key in (list(keys) if fmt is None else param_names(keys, fmt)):
        name, expert = _hf_param_name(key, arch.hf_renames)
        if expert is None:
            plain[name] = (keys.get(key, ""), key)
        else:
            experts.setdefault(name, {})[expert] = (keys.get(key, ""), key)
    out = {name: (where,) for name, where in plain.items()}
    if arch.hf_stacked_experts:  # gpt-oss: stacked, transposed, maybe MXFP4
        out = stacked_expert_index(out, path)
    for name, parts in experts.items():
        if cfg.num_experts and sorted(parts) != list(range(cfg.num_experts)):
            odd = sorted(set(parts) ^ set(range(cfg.num_experts)))
            raise ValueError(f"{path}: {name} has experts {sorted(parts)[:4]}... ({len(parts)}), not 0..."
                             f"{cfg.num_experts - 1} as config.json says (first odd one: {odd[0]})")
        out[name] = tuple(parts[e] for e in range(cfg.num_experts))
    check_tensor_names(out, cfg, path, fused=arch.fused_projections,
                       expected=entry_of(cfg).param_shapes(cfg))
    return out


def check_hf_folder(path: str) -> ModelConfig:
    """The config of an HF folder after checking, without reading weights, that tokenmill runs it exactly: its
    architecture and config fields (engine.model.architectures), its quantization_config and every tensor name.
    Raises ValueError."""
    cfg = read_hf_config(path)
    hf_tensor_index(path, cfg)
    return cfg


def iter_hf_quantized_state(path: str, cfg: ModelConfig, dtype: torch.dtype,
                            keep: KeepStored | None) -> tuple[Iterator[tuple[str, Any]], QuantReport]:
    """(iterator, report) over a quantized HF folder's parameters (engine.loading.hf_quantized.iter_quantized_state:
    INT4 / INT8 as stored where `keep` holds them exactly, else dequantized exactly to `dtype`; keep None: all
    dequantized; a tied LM head left out; a mixture-of-experts layer's per-expert layers stacked: stack_experts); the
    report fills as the iterator runs. Names are checked before the first tensor is read. Raises ValueError as
    hf_tensor_index, and for a folder without quantization_config."""
    fmt = hf_quant_format(path)
    if fmt is None:
        raise ValueError(f"{path} has no quantization_config")
    hf_tensor_index(path, cfg)
    report = QuantReport(fmt.describe())
    tied = f"{LM_HEAD}.weight" if cfg.tie_word_embeddings else None
    renames = get_architecture(cfg.architecture).hf_renames
    items = iter_quantized_state(hf_weight_files(path), fmt, lambda key: _quantized_name(key, renames), dtype, keep,
                                 report, skip=lambda name: name == tied)
    return (stack_experts(items, cfg.num_experts, dtype, report) if cfg.num_experts else items), report


def iter_hf_state(path: str, cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor in `dtype`) per parameter of an HF folder (a tied LM head left out), one tensor at a time
    from the safetensors files (a quantized folder's layers dequantized exactly: iter_hf_quantized_state; fused
    Q/K/V and gate/up split into their parts: engine.model.tensor_names.split_fused; a mixture-of-experts layer's
    per-expert weights stacked into one [E, out, in]; gpt-oss's stacked, interleaved and MXFP4 experts through
    engine.loading.gpt_oss_tensors); every name checked before the first is read. Raises ValueError as
    hf_tensor_index."""
    import torch
    from safetensors import safe_open

    if hf_quant_format(path) is not None:
        yield from iter_hf_quantized_state(path, cfg, dtype, keep=None)[0]
        return
    index = hf_tensor_index(path, cfg)
    with contextlib.ExitStack() as stack:  # every file open once (a layer's experts may span shards)
        files = {file: stack.enter_context(safe_open(file, framework="pt"))
                 for file in dict.fromkeys(file for parts in index.values() for file, _ in parts)}
        stacked = StackedExpertReader(files, dtype) if get_architecture(cfg.architecture).hf_stacked_experts else None
        for name, parts in index.items():
            if cfg.tie_word_embeddings and name == f"{LM_HEAD}.weight":
                continue
            if stacked is not None and ".experts." in name:
                yield name, stacked.read(name, parts)
            elif len(parts) == 1 and ".experts." not in name:
                file, key = parts[0]
                yield from split_fused(name, files[file].get_tensor(key).to(dtype), cfg)
            else:  # a stacked expert weight [E, out, in]
                yield name, torch.stack([files[file].get_tensor(key).to(dtype) for file, key in parts])
