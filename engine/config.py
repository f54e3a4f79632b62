"""Frozen, validated configs of the model shape and of the engine."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are changed from theta ** (-2i / head_dim), as HF transformers'
    `ROPE_INIT_FUNCTIONS` (transformers/modeling_rope_utils.py) computes them (engine.layers.rope.rope_inv_freq).

    Attributes:
        rope_type: "linear" (position interpolation, Chen et al. 2023: inv_freq / factor), "dynamic" (dynamic NTK:
            the base grows with the sequence length past max_position_embeddings), "yarn" (Peng et al., YaRN, 2023)
            or "llama3" (Meta Llama 3.1's wavelength-banded scaling).
        factor: the scaling factor (all types).
        original_max_position_embeddings: pretraining context (llama3, yarn).
        low_freq_factor / high_freq_factor: llama3's band edges.
        beta_fast / beta_slow / mscale / mscale_all_dim / attention_factor / truncate: yarn's parameters (None =
            transformers' defaults).
        freq_factors: per-frequency divisors of the unscaled inv_freq [head_dim / 2] (GGUF `rope_freqs.weight`, as
            llama.cpp's converter writes Llama 3's scaling); when set they are used instead of the llama3 formula.

    Raises:
        ValueError: for an unknown rope_type or a missing parameter.
    """

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not implemented; tokenmill runs "
                             f"{', '.join(ROPE_TYPES[1:])} (or none)")
        if self.freq_factors is not None:
            object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.freq_factors is None and None in (
                self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings):
            raise ValueError("rope_scaling llama3 needs low_freq_factor, high_freq_factor and "
                             "original_max_position_embeddings (or GGUF rope_freqs)")
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ValueError("rope_scaling yarn needs original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Touvron et al., "LLaMA", 2023; GQA: Ainslie et al., 2023).

    Attributes:
        vocab_size: number of token ids.
        hidden_size: model width d_model.
        intermediate_size: SwiGLU hidden width.
        num_layers: decoder blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention; num_heads % num_kv_heads == 0).
        head_dim: width of one head (usually hidden_size // num_heads).
        rope_theta: RoPE base frequency (Su et al., RoFormer, 2021).
        rms_norm_eps: epsilon of RMSNorm (Zhang & Sennrich, 2019).
        max_position_embeddings: the model's context length in tokens.
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        bos_token_id / eos_token_id: special ids from the model file.
        architecture: the family's registry name (engine.model.architectures: "llama", "qwen2", "qwen3"), for summaries;
            the model and kernels read the fields below, never this.
        qkv_bias: q_proj/k_proj/v_proj carry a bias (Qwen2).
        qk_norm: per-head RMSNorm of queries and keys before RoPE (q_norm / k_norm, [head_dim]; Qwen3).
        rope_scaling: RopeScaling, or None for plain RoPE (a dict, as JSON holds it, is converted).
        eos_token_ids: every token id that ends a sequence (generation_config.json's `eos_token_id` list; Llama 3's
            <|eot_id|> and <|end_of_text|>); eos_token_id is one of them.
        sliding_window: when set (W >= 1), the query at position i attends only to keys at positions j with
            i - W < j <= i: the last W keys, its own included (Mistral; Jiang et al., "Mistral 7B", 2023; the same
            boundary as HF transformers' `sliding_window_overlay`). None: full causal attention.

    Raises:
        ValueError: when the shape is inconsistent.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architecture: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        ids = tuple(int(i) for i in self.eos_token_ids)
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids = (int(self.eos_token_id), *ids)
        object.__setattr__(self, "eos_token_ids", ids)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be None or an int >= 1 (tokens), got "
                             f"{self.sliding_window!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """The config saved as `dataclasses.asdict(cfg)` (JSON: the weights cache, tokenmill folders). Raises
        ValueError naming a field this version does not know (a newer writer)."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"model config has fields {sorted(unknown)} this tokenmill does not know; upgrade it")
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the engine: device, KV cache size and batch limits.

    Attributes:
        device: "cpu", "cuda", "cuda:1", ... ("auto" = cuda when available, else cpu).
        dtype: "float32", "bfloat16" or "float16" for activations, weights and KV cache ("auto" = bfloat16 on cuda
            and on cpus with native bf16 (AVX512-BF16 / AMX), float32 on other cpus).
        block_size: tokens per KV cache block (PagedAttention, Kwon et al., SOSP 2023).
        num_kv_blocks: blocks in the KV pool; None sizes it from `kv_cache_memory_bytes` (cpu), or (cuda) from
            `gpu_memory_utilization` x the GPU's total memory minus what is already in use (weights included) and
            the logits of the largest step; either way capped at what max_num_seqs requests of max_model_len tokens
            could ever hold.
        kv_cache_memory_bytes: KV pool size in bytes on cpu when num_kv_blocks is None; None ("auto") = half the
            memory available to the process when the pool is sized, after the weights (engine.worker.device.
            CPU_KV_MEMORY_SHARE; a container's cgroup limit counts), its pages taken as blocks are first used.
        memory_limit_bytes: the most memory the process may hold (a Dask worker's memory limit; set by
            jobs.plugin), or None; an auto-sized CPU pool then takes at most half of what the process does not
            hold yet of it as well.
        gpu_memory_utilization: share (0, 1] of the GPU's total memory the engine may hold, weights included.
        max_num_seqs: most requests decoding at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes); a longer prompt is prefilled in
            chunks of at most this many tokens.
        max_model_len: most tokens (prompt + output) of one request; None = the model's context length.
        seed: seed of the engine's generator for requests without their own seed.
        enable_prefix_caching: reuse the KV blocks of identical prompt prefixes (a shared system prompt, the chat
            template) across requests instead of recomputing them.
        quantization: how weights are held (engine.loading.quantized): "none" = all dequantized to `dtype` (the
            reference path); "auto" = weights stored as INT4 stay INT4 (GGUF Q4_0/Q4_1/Q4_K natively, INT4 folders);
            "int4" = "auto" plus every other projection quantized to INT4 on load (W4A16, group-wise);
            "int8" = W8A8 on the CPU (int8 weights per channel, int8 activations per token; oneDNN).
        int4_group_size: input features per scale/zero group when quantizing on load (32, 64, 128 or 256).
        attention_backend: "auto" (the Triton kernels on CUDA when triton imports; on CPU the C++ decode kernel,
            engine.layers.attention.paged_attention_cpu; else the torch reference), "triton"
            (engine.layers.triton_attention; on
            CPU only under TRITON_INTERPRET=1), "cpu" or "torch" (engine.layers.attention.paged_attention_ref).
        enforce_eager: never capture CUDA graphs. Otherwise, on CUDA with the Triton backend, decode steps replay
            graphs captured once per batch-size bucket (engine.worker.cuda_graph) on their first use.
        async_scheduling: plan and queue step n + 1 on the device before step n's tokens reach the host, so the
            host's work of a step (stop checks, outputs, scheduling, inputs) overlaps the device's (LLMEngine.step
            says how; the tokens are the ones synchronous steps give). None ("auto") = on for CUDA, off on the CPU,
            where the host and the model share the cores and a stopped request's extra step would cost compute.

    Raises:
        ValueError: when a value is out of range.
    """

    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    memory_limit_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    quantization: str = "none"
    int4_group_size: int = 128
    attention_backend: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None (auto), got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1 or None (auto), got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens or None, got {self.max_model_len}")
        if self.quantization not in ("none", "auto", "int4", "int8"):
            raise ValueError(f"quantization must be none, auto, int4 or int8, got {self.quantization!r}")
        if self.int4_group_size not in (32, 64, 128, 256):
            raise ValueError(f"int4_group_size must be 32, 64, 128 or 256, got {self.int4_group_size}")
        if self.attention_backend not in ("auto", "triton", "cpu", "torch"):
            raise ValueError(f"attention_backend must be auto, triton, cpu or torch, got {self.attention_backend!r}")
