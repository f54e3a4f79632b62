"""The decoder's fused elementwise ops on the GPU, in Triton, with the contracts of the C++ CPU ops
(engine/kernels/csrc/cpu_kernels.cpp, engine.kernels.cpu_kernels.cpu_ops()): `rms_norm`, `add_rms_norm`, `silu_and_mul`,
`rope_write_kv`. engine.layers.rms_norm.fused_ops hands this module to the model's layers for CUDA activations, as it
hands them the C++ module for CPU ones; the torch path runs where neither serves.

On CUDA the torch path runs each of these as several kernels over [T, hidden] or [T, intermediate] (RMSNorm in fp32
alone is about seven); each op here is one kernel that reads its inputs once and writes its outputs once. Their
numerics are the torch path's, op by op (see engine/kernels/triton_fused_kernels.py), so greedy output in fp32 is
unchanged
and bf16 differs only in the last bit of fp32 arithmetic. Every op is CUDA-graph capturable: no host sync, outputs
sized from shapes only.

Triton is imported lazily, on the first call; without it (or with TOKENMILL_TRITON_FUSED=0) `triton_fused_ops()`
is None and the torch path runs. Under TRITON_INTERPRET=1 (set before triton is first imported) the kernels run in
Triton's interpreter on CPU tensors: the tests. Sources: vLLM's fused_add_rms_norm, silu_and_mul and
rotary_embedding + reshape_and_cache (csrc/layernorm_kernels.cu, activation_kernels.cu, cache_kernels.cu).
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

import torch

from schemas import settings

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The largest row RMSNorm keeps in registers in one program (Llama 3.1 405B's hidden is 16384).
MAX_HIDDEN = 65536
SILU_BLOCK = 1024
ROPE_MAX_BLOCK_H = 16


@functools.cache
def triton_fused_ops() -> ModuleType | None:
    """This module when its kernels can run: triton imports and TOKENMILL_TRITON_FUSED is not "0"; else None (the
    torch path runs). Read once per process (tests call `triton_fused_ops.cache_clear()` after changing the
    variable). Only ImportError means "no triton": a broken install raises."""
    if not settings.env_flag(settings.TRITON_FUSED):
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    return sys.modules[__name__]


def _kernels() -> ModuleType:
    """The `@triton.jit` kernels, imported on first use (importing them imports triton)."""
    from engine.kernels import triton_fused_kernels

    return triton_fused_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError unless t has `dim` dims, a dtype the kernels serve (or `dtype`) and a device they run on."""
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")
    want = DTYPES if dtype is None else (dtype,)
    if t.dtype not in want:
        raise ValueError(f"{name} dtype {t.dtype} not served by the Triton fused ops; want one of {want}")
    interpreting = settings.triton_interpret()
    if (t.device.type == "cuda") == interpreting:
        raise ValueError(f"{name} is on {t.device}: the Triton fused ops need CUDA tensors (CPU tensors only under "
                         "TRITON_INTERPRET=1)")


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check("x", x, 2)
    _check("weight", weight, 1, x.dtype)
    tokens, hidden = x.shape
    if weight.shape[0] != hidden or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{hidden}] (x's hidden size), got {tuple(weight.shape)}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the Triton RMSNorm's {MAX_HIDDEN}; use the torch path")
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    total = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            raise ValueError(f"residual must be contiguous {tuple(x.shape)} of {x.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        total = torch.empty_like(out)
    if tokens == 0:
        return out, total
    block = _next_pow2(hidden)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4 if block >= 512 else 1
    _kernels().rms_norm_kernel[(tokens,)](
        x, residual if residual is not None else x, total if total is not None else out, weight, out,
        x.stride(0), x.stride(1), hidden, float(eps), HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=num_warps)
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row (Zhang & Sennrich, 2019), in fp32 as HF transformers' LlamaRMSNorm: round(weight *
    round(x * rsqrt(mean(x^2) + eps))). x: [T, hidden] fp32/fp16/bf16 (any strides); weight: [hidden] of x's dtype.
    Returns a new contiguous [T, hidden] of x's dtype. Raises ValueError on other shapes, dtypes or devices."""
    return _rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), the sum rounded to the dtype before it is normalized (the decoder's
    skip connection fused into the next norm, as vLLM's fused_add_rms_norm). x, residual: [T, hidden] of one dtype,
    residual contiguous; weight [hidden]. Both outputs are new tensors. Raises ValueError as `rms_norm`."""
    out, total = _rms_norm(x, residual, weight, eps)
    return out, total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer, 2020): silu(gate_up[:, :I]) * gate_up[:, I:] -> new contiguous [T, I] of gate_up's
    dtype, silu and the product each rounded to the dtype as torch's F.silu(gate) * up. gate_up: [T, 2I]
    fp32/fp16/bf16. Raises ValueError on other shapes (an odd width), dtypes or devices."""
    _check("gate_up", gate_up, 2)
    tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must be [T, 2I]; its width {width} is odd")
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens and inter:
        block = min(SILU_BLOCK, _next_pow2(inter))
        _kernels().silu_and_mul_kernel[(tokens, -(-inter // block))](
            gate_up, out, inter, gate_up.stride(0), gate_up.stride(1), BLOCK=block, num_warps=4)
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """RoPE (Su et al., RoFormer, 2021; HF's rotate-half form: x * cos + rotate_half(x) * sin, each op rounded to the
    dtype) of the Q and K heads of a fused QKV, with K (rotated) and V stored into the paged cache at
    slot_mapping (engine.layers.attention.write_kv's layout). One kernel.

    qkv: [T, (num_heads + 2 Hkv) * D] with contiguous rows; cos, sin: contiguous [T, R] of qkv's dtype, R <= D even
    (the first R dims of each head rotate, the others are copied: partial rotary, HF's Phi-3 form); k_cache,
    v_cache: contiguous [num_blocks, block_size, Hkv, D] of qkv's dtype; slot_mapping: int64 [T] (a negative slot
    writes nothing: a padded row). Returns the rotated Q, a new [T, num_heads, D]. Raises ValueError on shapes,
    dtypes or devices it does not serve.
    """
    _check("qkv", qkv, 2)
    for name, t in (("cos", cos), ("sin", sin)):
        _check(name, t, 2, qkv.dtype)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, t, 4, qkv.dtype)
    _check("slot_mapping", slot_mapping, 1, torch.int64)
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    heads = num_heads + 2 * num_kv_heads
    if qkv.shape[1] != heads * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim] = [T, {heads * head_dim}] "
                         f"with contiguous rows, got {tuple(qkv.shape)} strides {qkv.stride()}")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    rot = cos.shape[1]
    if (cos.shape[0] != tokens or not 2 <= rot <= head_dim or rot % 2 or sin.shape != cos.shape
            or not (cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"cos and sin must be contiguous [{tokens}, R], R <= {head_dim} even, got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"k_cache and v_cache must be contiguous, of one shape; got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if slot_mapping.shape[0] != tokens or not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous int64 [{tokens}], got {tuple(slot_mapping.shape)}")
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        block_h = min(ROPE_MAX_BLOCK_H, _next_pow2(heads))
        _kernels().rope_write_kv_kernel[(tokens, -(-heads // block_h))](
            qkv, cos, sin, slot_mapping, q, k_cache, v_cache, qkv.stride(0), num_heads, num_kv_heads,
            HEAD_DIM=head_dim, ROT_DIM=rot, HALF_PAD=_next_pow2(rot // 2), PASS_PAD=_next_pow2(head_dim - rot),
            BLOCK_H=block_h, num_warps=4)
    return q
