"""Whether a model fits a device, before any work: the weights' bytes on the device, the KV cache's bytes per token,
the KV pool that remains and how many sequences of max_model_len it holds.

vLLM answers the same question after loading and profiling (`determine_available_memory`, then
`_check_enough_kv_cache_memory`: "To serve at least one request with the model's max seq len, ... GiB KV cache is
needed"); here it is answered from the shapes alone, so a client refuses a job before a worker loads a 140 GB
model to find out. The KV pool's formula is the engine's own (engine.worker.device.num_kv_blocks shares
`cuda_kv_budget_bytes`), with the weights counted as they will be held:

- plain weights: numel x the run dtype's size (a tied LM head shares the embedding);
- INT4 weights: 0.5 byte per weight plus a bf16 scale and zero per group, on CUDA twice (INT4_CUDA_COPIES: the
  engine keeps tinygemm's packed copy beside GemLite's or the dequantize path's, engine.quant.int4_linear), on the
  CPU once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from engine.config import EngineConfig, ModelConfig

#: Packed copies of each INT4 weight the engine keeps on CUDA by default (engine.quant.int4_linear: tinygemm's for
#: small M beside GemLite's, or beside the portable copy its dequantize path reads).
INT4_CUDA_COPIES = 2
GIB = 1 << 30


def int4_bytes(numel: int, group_size: int, device_type: str) -> int:
    """Device bytes of an INT4 weight of `numel` weights at `group_size`: packed nibbles plus bf16 scale and zero
    per group, times the copies the engine keeps on `device_type` ("cuda" or "cpu")."""
    one = numel // 2 + numel // group_size * 2 * 2
    return one * (INT4_CUDA_COPIES if device_type == "cuda" else 1)


def weight_bytes(tensors: Iterable[tuple[int, int | None]], dtype: torch.dtype, device_type: str) -> int:
    """Device bytes of a model's weights: `tensors` = (numel, INT4 group size or None for a plain tensor in
    `dtype`) per weight the model holds (a tied LM head left out)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(numel * size if group is None else int4_bytes(numel, group, device_type) for numel, group in tensors)


def model_tensors(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(name, numel) of every weight of a model of shape `cfg` (HF names without "model."; a tied LM head left out),
    built on the meta device: no memory."""
    from engine.model.decoder import LlamaModel
    from engine.model.tensor_names import LM_HEAD

    with torch.device("meta"):
        model = LlamaModel(cfg, 1)
    return [(name, p.numel()) for name, p in model.state_dict().items()
            if not (cfg.tie_word_embeddings and name == f"{LM_HEAD}.weight")]


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes across all layers (K and V)."""
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


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
    fit); max_model_len: the longest sequence asked for; block_size: tokens per KV block."""

    device: str
    memory_bytes: int
    model_bytes: int
    kv_bytes_per_token: int
    kv_pool_bytes: int
    max_model_len: int
    block_size: int

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds (whole blocks)."""
        per_block = self.kv_bytes_per_token * self.block_size
        return max(self.kv_pool_bytes, 0) // per_block * self.block_size

    @property
    def sequence_bytes(self) -> int:
        """KV bytes of one sequence of max_model_len tokens (whole blocks)."""
        return -(-self.max_model_len // self.block_size) * self.block_size * self.kv_bytes_per_token

    @property
    def sequences(self) -> int:
        """Sequences of max_model_len tokens the pool holds at once."""
        return max(self.kv_pool_bytes, 0) // self.sequence_bytes

    def line(self) -> str:
        """One line stating the numbers."""
        return (f"memory on {self.device}: {self.memory_bytes / GIB:.2f} GiB usable, model {self.model_bytes / GIB:.2f}"
                f" GiB, KV {self.kv_bytes_per_token / 1024:.1f} KiB per token, KV pool "
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

    def as_dict(self) -> dict[str, int | str]:
        """JSON-ready numbers, with pool_tokens and sequences."""
        return {**asdict(self), "pool_tokens": self.pool_tokens, "sequences": self.sequences}
