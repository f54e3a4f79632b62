"""The engine's knobs (EngineConfig): device, dtype, KV cache size, batch limits, weight quantization, and a
vision-language model's image pixel limits. Its own module beside engine.config (the model's shape), which
re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from schemas import engine_choices as ec


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the engine: device, KV cache size and batch limits. The choices of dtype, quantization,
    int4_group_size and attention_backend, and max_num_seqs' default, are schemas.engine_choices' (the job spec's
    too).

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
            "int4" = "auto" plus every other projection (experts too) quantized to INT4 on load (W4A16, group-wise);
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
        max_image_pixels / min_image_pixels: a vision-language model's pixel limits of one image (width x height
            after its processor resizes it), set through its own HF image processor's parameters (engine.multimodal.
            pixel_limits: Qwen2-VL's size, Idefics3's longest edge, LLaVA-NeXT's grid pinpoints); None = the
            processor's own. A value the processor cannot honour is a ValueError when the model loads; a text-only
            model ignores them.

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
    max_num_seqs: int = ec.DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    quantization: str = "none"
    int4_group_size: int = ec.DEFAULT_INT4_GROUP_SIZE
    attention_backend: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    max_image_pixels: int | None = None
    min_image_pixels: int | None = None

    def __post_init__(self) -> None:
        for name, choices in (("dtype", ec.DTYPES), ("quantization", ec.QUANTIZATIONS),
                              ("int4_group_size", ec.INT4_GROUP_SIZES), ("attention_backend", ec.ATTENTION_BACKENDS)):
            problem = ec.choice_problem(name, getattr(self, name), choices)
            if problem is not None:
                raise ValueError(problem)
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
        for name in ("max_image_pixels", "min_image_pixels"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (pixels: width x height) or None, got {value!r}")
        if (self.min_image_pixels or 0) > (self.max_image_pixels or self.min_image_pixels or 0):
            raise ValueError(f"min_image_pixels {self.min_image_pixels} is above max_image_pixels "
                             f"{self.max_image_pixels}; give min <= max")
