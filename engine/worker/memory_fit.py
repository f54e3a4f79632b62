"""Whether a model fits a device, before any work: the weights' bytes on the device, the KV cache's bytes per token,
the KV pool that remains and how many sequences of max_model_len it holds.

vLLM answers the same question after loading and profiling (`determine_available_memory`, then
`_check_enough_kv_cache_memory`: "To serve at least one request with the model's max seq len, ... GiB KV cache is
needed"); here it is answered from the shapes alone, so a client refuses a job before a worker loads a 140 GB
model to find out. The KV pool's formula is the engine's own (engine.worker.device.num_kv_blocks shares
`cuda_kv_budget_bytes`), with the weights counted as they will be held:

- plain weights: numel x the run dtype's size (a tied LM head shares the embedding);
- INT4 weights: 0.5 byte per weight plus a bf16 scale and zero per group, times the packed copies the engine keeps:
  on CUDA two under the "dual" layout (tinygemm's for small M beside GemLite's, or beside the dequantize path's
  portable copy without GemLite; engine.quant.int4_linear) and one under "single" (GemLite's only; tinygemm's only
  without GemLite), on the CPU one. choose_int4_layout picks the layout per model and device, for the engine at load
  and for the preflight alike, so both count the same bytes;
- INT4 mixture-of-experts experts (a stacked projection: HeldWeight.experts) on CUDA where the grouped INT4 kernel
  serves them (grouped_int4_experts_expected): one copy whatever the layout, the stacked weights with their scales
  and zeros as stored (HeldWeight.scale_bytes: fp32 from GGUF and quantized HF folders, bf16 when tokenmill
  quantized them); elsewhere as the other INT4 weights (one module per expert: engine.quant.experts).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, NamedTuple

from engine.config import EngineConfig, ModelConfig
from engine.core.kv_cache_spec import KVCacheSpec, layout_bytes_per_token
from schemas import settings

if TYPE_CHECKING:
    import torch

#: Packed copies of each INT4 weight on CUDA per layout (engine.quant.int4_linear.Int4Linear's tinygemm_max_rows:
#: "dual" = tinygemm's copy for M <= 8 beside GemLite's, "single" = GemLite's alone at every M).
INT4_CUDA_COPIES = {"dual": 2, "single": 1}
#: "dual" is chosen only when its second copy leaves at least this share of the KV pool that one copy leaves (or
#: all the pool the engine can use: max_num_seqs sequences of max_model_len). What the second copy buys: tinygemm at
#: M <= 8, faster than (untuned) GemLite per layer on an H200 (bench/README.md "INT4 with GemLite: H200,
#: 2026-11-26"); what it costs: KV blocks, i.e. concurrent sequences at every M.
INT4_DUAL_MIN_KV_SHARE = 0.9
GIB = 1 << 30
#: Bytes per element of each run dtype, by name (what torch's element_size gives): the fit check runs in the CLI's
#: client, which never imports torch (issue 31).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: MemoryFit's pool_tokens / sequences of a model without a KV cache (every layer's KVCacheSpec of kind "none"): the
#: pool bounds nothing.
NO_KV_LIMIT = 1 << 62



class HeldWeight(NamedTuple):
    """One weight of a model as the engine holds it (weight_bytes). The lists weight_bytes takes hold plain tuples
    of its fields, (numel, group) or all four (engine.quant.handler.held_tensors and jobs.plan.model_fit build them, and
    engine.quant cannot import engine.worker); HeldWeight(*t) reads either.

    numel: its weights (an INT4 one's at the width counted: padded by the engine's own count, unpadded from
    headers); group: INT4 group size, None for a plain tensor in the run dtype; experts: a stacked
    mixture-of-experts projection (all its experts), held once on CUDA by the grouped INT4 kernel
    (grouped_int4_experts_expected); scale_bytes: bytes of each scale and zero as that kernel holds them (stored)."""

    numel: int
    group: int | None = None
    experts: bool = False
    scale_bytes: int = 2


#: The INT4 layout of a model from its shape and its weights as weight_bytes takes them (int4_layout_chooser).
Int4LayoutChooser = Callable[[ModelConfig, list[tuple]], str]


def grouped_int4_experts_expected(device_type: str) -> bool:
    """Whether INT4 experts on `device_type` ("cuda", "cpu") will run on the grouped INT4 kernel and be held once
    (engine.quant.experts.grouped_int4_experts decides it at load): CUDA with triton installed and
    TOKENMILL_TRITON_MOE not 0, as engine.kernels.triton_moe.triton_moe_ops checks, told here without importing
    torch or triton (the preflight's client imports neither)."""
    return (device_type == "cuda" and settings.env_flag(settings.TRITON_MOE)
            and importlib.util.find_spec("triton") is not None)


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a run dtype: a torch.dtype (torch.float32, ...) or its name ("float32", "bfloat16",
    "float16": DTYPE_BYTES). Raises ValueError for another dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"no run dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def int4_bytes(numel: int, group_size: int, device_type: str, layout: str = "dual", *, grouped: bool = False,
               scale_bytes: int = 2) -> int:
    """Device bytes of an INT4 weight of `numel` weights at `group_size`: packed nibbles plus bf16 scale and zero
    per group, times the copies the engine keeps on `device_type` ("cuda" or "cpu") under `layout` ("dual" or
    "single", INT4_CUDA_COPIES; the CPU keeps one whatever the layout). `grouped` (CUDA: stacked experts on the
    grouped INT4 kernel): one copy whatever the layout, scales and zeros of `scale_bytes` each."""
    if grouped and device_type == "cuda":
        return numel // 2 + numel // group_size * 2 * scale_bytes
    one = numel // 2 + numel // group_size * 2 * 2
    return one * (INT4_CUDA_COPIES[layout] if device_type == "cuda" else 1)


def weight_bytes(tensors: Iterable[tuple], dtype: torch.dtype | str, device_type: str,
                 layout: str = "dual", grouped_experts: bool | None = None) -> int:
    """Device bytes of a model's weights: `tensors` = one HeldWeight's fields per weight the model holds (a tied LM
    head left out): plain ones in `dtype` (a torch.dtype or its name, dtype_bytes), INT4 ones as int4_bytes under
    `layout`, stacked experts as the grouped INT4 kernel holds them where `grouped_experts` (None:
    grouped_int4_experts_expected(device_type))."""
    size = dtype_bytes(dtype)
    grouped = grouped_int4_experts_expected(device_type) if grouped_experts is None else grouped_experts
    held = [HeldWeight(*t) for t in tensors]
    return sum(w.numel * size if w.group is None else int4_bytes(
        w.numel, w.group, device_type, layout, grouped=grouped and w.experts, scale_bytes=w.scale_bytes)
        for w in held)


def choose_int4_layout(tensors: list[tuple], dtype: torch.dtype | str, total: int, free: int,
                       config: EngineConfig, vocab_size: int, per_block: int, max_model_len: int) -> str:
    """The INT4 layout the engine uses for a model of `tensors` (as weight_bytes) on a CUDA device of `total` bytes
    with `free` free before loading: "dual" when the KV pool left with two packed copies (cuda_kv_budget_bytes) is
    at least INT4_DUAL_MIN_KV_SHARE of the pool one copy leaves, or already holds the most the engine uses
    (config.max_num_seqs sequences of `max_model_len` tokens, `per_block` bytes per KV block of config.block_size
    tokens); else "single" (GemLite alone: 0.5 byte per weight less, e.g. a Llama-3.1-70B fits an 80 GB H100).
    A model without INT4 weights gets "dual" (nothing to choose)."""
    if all(HeldWeight(*t).group is None for t in tensors):
        return "dual"
    pools = {layout: cuda_kv_budget_bytes(total, free, config, vocab_size, per_block,
                                          weight_bytes(tensors, dtype, "cuda", layout)) for layout in INT4_CUDA_COPIES}
    usable = config.max_num_seqs * -(-max_model_len // config.block_size) * per_block
    dual, single = pools["dual"], pools["single"]
    return "dual" if dual >= per_block and (dual >= INT4_DUAL_MIN_KV_SHARE * single or dual >= usable) else "single"


def model_tensors(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(name, numel) of every weight of a model of shape `cfg` (HF names without "model."; a tied LM head left out),
    from the config alone (its registry entry's param_shapes: no torch, no memory)."""
    from engine.model.registry import entry_of

    return [(name, math.prod(shape)) for name, shape in entry_of(cfg).param_shapes(cfg).items()]


def int4_layout_chooser(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Int4LayoutChooser:
    """What LLMEngine.from_model hands the loader before it reads a model: on CUDA, choose_int4_layout over the
    device's memory as it is now (before any weight is loaded) for the model's shape and weights; on the CPU,
    "dual" (one copy there whatever the layout)."""
    if device.type != "cuda":
        return lambda cfg, tensors: "dual"
    import torch

    from engine.model.registry import kv_cache_layout

    free, total = torch.cuda.mem_get_info(device)

    def choose(cfg: ModelConfig, tensors: list[tuple]) -> str:
        max_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        per_block = kv_layout_bytes_per_token(kv_cache_layout(cfg), dtype) * config.block_size
        return choose_int4_layout(tensors, dtype, total, free, config, cfg.vocab_size, per_block, max_len)

    return choose


def kv_layout_bytes_per_token(layout: Sequence[KVCacheSpec], dtype: torch.dtype | str) -> int:
    """KV cache bytes one token takes across the layers of `layout` (K and V; one KVCacheSpec per layer: the
    model's kv_cache_specs, or engine.model.registry.kv_cache_layout of its config), in `dtype` (a torch.dtype or
    its name). 0 for a model without a KV cache."""
    return layout_bytes_per_token(layout, dtype_bytes(dtype))


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype | str) -> int:
    """KV cache bytes one token takes across `layers` alike (K and V), in `dtype`: the uniform layout a model
    file's header gives (jobs.plan.model_fit) before any config is read; kv_layout_bytes_per_token reads a layout."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


def cuda_kv_budget_bytes(total: int, free: int, config: EngineConfig, vocab_size: int, per_block: int,
                         weights_to_come: int = 0) -> int:
    """Bytes the KV pool may take on a CUDA device of `total` bytes with `free` free now: gpu_memory_utilization x
    total, less what is in use (weights already loaded count there), less `weights_to_come` (a preflight's estimate
    of weights not loaded yet), the logits of the largest step (max_num_batched_tokens x vocab, fp32) and the scratch
    block of CUDA graphs' padded rows. Negative when nothing is left."""
    budget = int(total * config.gpu_memory_utilization) - (total - free) - weights_to_come
    return budget - config.max_num_batched_tokens * vocab_size * 4 - per_block


@dataclass(frozen=True)
class MemoryFit:
    """A model against a device's memory (bytes; tokens).

    device: where it runs, in words; memory_bytes: what the engine may use there (CUDA: gpu_memory_utilization x
    the card less other processes' use; CPU: memory available); model_bytes: the weights there; kv_bytes_per_token:
    K and V of one token, all layers; kv_pool_bytes: what is left for the KV cache (negative: not even the weights
    fit); max_model_len: the longest sequence asked for; block_size: tokens per KV block; int4_layout: on CUDA with
    INT4 weights, the layout counted ("dual" or "single": choose_int4_layout), else None."""

    device: str
    memory_bytes: int
    model_bytes: int
    kv_bytes_per_token: int
    kv_pool_bytes: int
    max_model_len: int
    block_size: int
    int4_layout: str | None = None

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds (whole blocks); NO_KV_LIMIT for a model without a KV cache whose weights fit."""
        per_block = self.kv_bytes_per_token * self.block_size
        if per_block == 0:
            return NO_KV_LIMIT if self.kv_pool_bytes >= 0 else 0
        return max(self.kv_pool_bytes, 0) // per_block * self.block_size

    @property
    def sequence_bytes(self) -> int:
        """KV bytes of one sequence of max_model_len tokens (whole blocks)."""
        return -(-self.max_model_len // self.block_size) * self.block_size * self.kv_bytes_per_token

    @property
    def sequences(self) -> int:
        """Sequences of max_model_len tokens the pool holds at once (NO_KV_LIMIT without a KV cache, when the
        weights fit)."""
        if self.sequence_bytes == 0:
            return NO_KV_LIMIT if self.kv_pool_bytes >= 0 else 0
        return max(self.kv_pool_bytes, 0) // self.sequence_bytes

    def line(self) -> str:
        """One line stating the numbers."""
        int4 = f" (INT4 layout {self.int4_layout})" if self.int4_layout else ""
        if self.kv_bytes_per_token == 0:
            return (f"memory on {self.device}: {self.memory_bytes / GIB:.2f} GiB usable, model "
                    f"{self.model_bytes / GIB:.2f} GiB{int4}, no KV cache")
        return (f"memory on {self.device}: {self.memory_bytes / GIB:.2f} GiB usable, model {self.model_bytes / GIB:.2f}"
                f" GiB{int4}, KV {self.kv_bytes_per_token / 1024:.1f} KiB per token, KV pool "
                f"{max(self.kv_pool_bytes, 0) / GIB:.2f} GiB = {self.pool_tokens:,} tokens = {self.sequences:,} "
                f"concurrent sequences of --max-model-len {self.max_model_len:,}")

    def refusal(self, model: str, int4_model_bytes: int | None) -> str | None:
        """None when one sequence of max_model_len fits; else the one-line error naming the numbers and the ways
        out (`int4_model_bytes`: the weights' bytes with --quantization int4, None when they are INT4 already)."""
        if self.sequences >= 1:
            return None
        need = self.model_bytes + self.sequence_bytes + max(self.memory_bytes - self.model_bytes
                                                            - self.kv_pool_bytes, 0)
        ways = []
        if int4_model_bytes is not None and int4_model_bytes < self.model_bytes:
            ways.append(f"--quantization int4 (weights about {int4_model_bytes / GIB:.1f} GiB)")
        ways.append(f"a device with at least {need / GIB:.1f} GiB usable")
        if self.pool_tokens >= self.block_size:
            ways.append(f"--max-model-len {self.pool_tokens} or less")
        return (f"{model} does not fit one sequence of --max-model-len {self.max_model_len:,} tokens on "
                f"{self.device}: {self.memory_bytes / GIB:.2f} GiB usable, the weights take "
                f"{self.model_bytes / GIB:.2f} GiB, the KV cache {self.kv_bytes_per_token / 1024:.1f} KiB per token "
                f"({self.sequence_bytes / GIB:.3f} GiB per sequence), leaving {self.kv_pool_bytes / GIB:.2f} GiB "
                f"({self.pool_tokens:,} tokens). Ways out: {'; '.join(ways)}")

    def as_dict(self) -> dict[str, int | str | None]:
        """JSON-ready numbers, with pool_tokens and sequences."""
        return {**asdict(self), "pool_tokens": self.pool_tokens, "sequences": self.sequences}
