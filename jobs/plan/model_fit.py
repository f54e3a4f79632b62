"""The preflight's fit check (issue 42): a local model against the memory of the device the job's workers use on this
machine, from the model's header alone (GGUF tensor infos, config.json, tokenmill_model.json): the weights' bytes on
the device as --quantization will hold them, the KV cache's bytes per token, the KV pool that remains and the
sequences of --max-model-len it holds (engine.worker.memory_fit). A model that cannot hold one such sequence is exit
2 before any work, naming those numbers and the ways out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kernels.cpu_features import cpu_flags_native_bf16
from engine.loading.model_files import is_hub_id
from engine.worker.device_choice import choose_device, choose_dtype
from engine.worker.host import CPU_KV_MEMORY_SHARE, memory_available_bytes, nvidia_smi_gpus
from engine.worker.memory_fit import (
    GIB,
    MemoryFit,
    choose_int4_layout,
    cuda_kv_budget_bytes,
    kv_bytes_per_token,
    model_tensors,
    weight_bytes,
)
from jobs.errors import JobError
from jobs.plan.preflight import client_model_path


@dataclass(frozen=True)
class Device:
    """A device as the client names it: type "cpu" or "cuda", and the CUDA index (None: the current one); str() as
    torch.device's."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def resolve_device(device: str) -> Device:
    """The device engine.worker.device.resolve_device picks for `device`, by the same rule
    (engine.worker.device_choice) decided without torch (this client never imports it): "auto" is cuda when
    nvidia-smi lists a GPU, else cpu; an explicit name as given ("cuda:1"). Raises ValueError when cuda is asked for
    and nvidia-smi lists no GPU."""
    kind, _, index = choose_device(device, nvidia_smi_gpus).partition(":")
    return Device(kind, int(index) if index else None)


def resolve_dtype(dtype: str, device: Device) -> str:
    """The run dtype's name engine.worker.device.resolve_dtype picks, by the same rule (engine.worker.device_choice):
    an explicit name as given; "auto" is bfloat16 on CUDA and on a CPU with native bf16
    (engine.kernels.cpu_features.cpu_flags_native_bf16: the flags torch's probes read), else float32."""
    return choose_dtype(dtype, device.type, cpu_flags_native_bf16)


def _weights(path: str, quantization: str, group_size: int) -> tuple[list[tuple], int, list[tuple] | None]:
    """(numel, INT4 group or None) per weight of the model at `path` as `quantization` holds it, a stacked expert
    projection's INT4 as (numel, group, True, bytes per scale: 4 as GGUF and quantized HF folders store them, 2 for
    tokenmill's bf16) (engine.worker.memory_fit.HeldWeight's fields), its vocabulary size, and the same list under
    --quantization int4 (None when that is the mode already)."""
    from engine.loading.gguf_native_int4 import GGUF_GROUP_SIZE, gguf_weight_types, loads_as_native_int4
    from engine.loading.hf_folder import is_hf_folder, read_hf_config
    from engine.loading.model_files import TOKENMILL_CONFIG_FILE
    from engine.model.tensor_names import is_expert_weight, is_linear_weight

    # (numel, a linear or expert weight, INT4 group as stored, a stacked expert projection, bytes per stored scale)
    entries: list[tuple[int, bool, int | None, bool, int]] = []
    tied_head: list[tuple[int, int | None]] = []  # an INT4 embedding's tied LM head: an Int4Linear of its own
    if os.path.isdir(path):
        if is_hf_folder(path):
            from engine.loading.hf_quantized import read_quant_format

            cfg = read_hf_config(path)
            with open(os.path.join(path, "config.json")) as f:
                fmt = read_quant_format(json.load(f), path)
            group = (fmt.group_size if fmt.group_size > 0 else 128) if fmt is not None and fmt.bits == 4 else None
            int4_modules: set[str] | None = None  # every linear weight, when group
            scale_bytes = 4  # engine.loading.quant_groups: fp32 scales and zeros, exact
        else:
            from engine.config import ModelConfig

            with open(os.path.join(path, TOKENMILL_CONFIG_FILE)) as f:
                meta = json.load(f)
            cfg = ModelConfig.from_dict(meta["model_config"])
            quant = meta.get("quantization") or {}
            group, int4_modules = quant.get("group_size"), set(quant.get("modules", {}))
            scale_bytes = 2  # bf16 (engine.loading.tokenmill_folder)
        vocab = cfg.vocab_size
        for name, numel in model_tensors(cfg):
            linear = is_linear_weight(name) or is_expert_weight(name)
            int4 = group is not None and (linear if int4_modules is None else name.removesuffix(".weight")
                                          in int4_modules)
            entries.append((numel, linear, group if int4 else None, is_expert_weight(name), scale_bytes))
            if int4 and cfg.tie_word_embeddings and name == "embed_tokens.weight":
                tied_head.append((numel, group))
    else:
        gguf_tensors, vocab = gguf_weight_types(path)
        for name, numel, type_name in gguf_tensors:
            linear = is_linear_weight(name) or is_expert_weight(name)
            group = GGUF_GROUP_SIZE if loads_as_native_int4(name, type_name) else None
            entries.append((numel, linear, group, is_expert_weight(name), 4))

    def held(mode: str) -> list[tuple]:
        if mode in ("none", "int8"):
            return [(n, None) for n, *_ in entries]
        out = []
        for n, linear, stored, experts, scale_bytes in entries:
            group = stored or (group_size if mode == "int4" and linear else None)
            # quantized here: bf16 scales (engine.quant.handler.Int4QuantHandler)
            out.append((n, group, True, scale_bytes if stored else 2) if experts and group else (n, group))
        return out + tied_head

    return held(quantization), vocab, None if quantization == "int4" else held("int4")


def _cuda_memory(index: int) -> tuple[int, int, str]:
    """(free, total bytes, name) of CUDA device `index`, from nvidia-smi where present (no CUDA context in this
    client process, whose workers need the memory), else torch (free taken as total: no other process counted)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, f"--id={index}", "--query-gpu=memory.total,memory.used,name",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout.strip().splitlines()[0]
            total, used, name = (x.strip() for x in out.split(",", 2))
            return (int(total) - int(used)) << 20, int(total) << 20, name
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    import torch

    props = torch.cuda.get_device_properties(index)
    return props.total_memory, props.total_memory, props.name


def model_fit(model: str, config: EngineConfig, shape: dict[str, int]) -> MemoryFit:
    """The MemoryFit of the local model at `model` (a GGUF file or a folder; `shape`:
    jobs.plan.preflight.model_context's layers, kv_heads, head_dim and context) under `config` on the device
    config.device resolves to here."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tensors, vocab, _ = _weights(model, config.quantization, config.int4_group_size)
    per_token = kv_bytes_per_token(shape["layers"], shape["kv_heads"], shape["head_dim"], dtype)
    max_len = min(config.max_model_len or shape["context"], shape["context"])
    layout = None
    if device.type == "cuda":
        free, total, name = _cuda_memory(device.index or 0)
        if any(t[1] is not None for t in tensors):  # the engine's own choice, from the same numbers
            layout = choose_int4_layout(tensors, dtype, total, free, config, vocab, per_token * config.block_size,
                                        max_len)
        model_bytes = weight_bytes(tensors, dtype, device.type, layout or "dual")
        memory = int(total * config.gpu_memory_utilization) - (total - free)
        pool = cuda_kv_budget_bytes(total, free, config, vocab, per_token * config.block_size, model_bytes)
        where = f"{device} ({name}, {total / GIB:.1f} GiB, gpu_memory_utilization {config.gpu_memory_utilization})"
    else:
        model_bytes = weight_bytes(tensors, dtype, device.type)
        memory = memory_available_bytes()
        pool = config.kv_cache_memory_bytes if config.kv_cache_memory_bytes is not None else int(
            CPU_KV_MEMORY_SHARE * (memory - model_bytes))
        if model_bytes > memory:
            pool = min(pool, memory - model_bytes)
        where = "cpu"
    return MemoryFit(where, memory, model_bytes, per_token, pool, max_len, config.block_size, layout)


def check_fit(model: str | None, config: EngineConfig, shape: dict[str, int] | None) -> MemoryFit | None:
    """model_fit of a local model (None for `shape` None: a model at a URL, checked by its worker), or JobError
    (exit 2) when it cannot hold one sequence of --max-model-len: the numbers and the ways out. None too for an
    explicit --device cuda where nvidia-smi lists no GPU (a container without it): the client cannot read the card's
    memory without torch, and whether CUDA is there at all is the engine's to say when it loads."""
    if shape is None or not shape.get("layers"):
        return None
    try:
        resolve_device(config.device)
    except ValueError:  # CUDA asked for where nvidia-smi lists no GPU: the engine checks it when it loads
        return None
    path = client_model_path(model)
    if path is None:
        return None
    fit = model_fit(path, config, shape)
    _, _, int4 = _weights(path, config.quantization, config.int4_group_size)
    device = resolve_device(config.device)
    # the ways out name INT4's smallest bytes: one packed copy (the layout the engine picks where two do not fit)
    int4_bytes = None if int4 is None else weight_bytes(int4, resolve_dtype(config.dtype, device), device.type,
                                                        "single")
    name = ("the default model (SmolLM2-135M-Instruct)" if model is None
            else f"--model {model if is_hub_id(model) else os.path.basename(path)}")
    if (line := fit.refusal(name, int4_bytes)) is not None:
        raise JobError(line)
    return fit
