"""Linear layers with weights pre-packed for oneDNN on the CPU: the serving form of the model's GEMMs there.

`F.linear` on a CPU tensor reorders the weight into the GEMM library's blocked layout on every call (or goes
through MKL's sgemm for fp32, which is slower at these shapes). Packing it once, as PyTorch Inductor's CPU
freezing pass does (`torch.ops.mkldnn._reorder_linear_weight`, then `torch.ops.mkldnn._linear_pointwise`; both
in torch since 2.0), saves that work at every step: faster than F.linear in bf16 and fp32 at SmolLM2-135M's
shapes (`python -m bench.cpu_kernels --gemm`; figures, device and date in bench/README.md "CPU kernels
(microbenchmarks)" and "Figures once quoted in engine/'s docstrings").

bf16 results equal F.linear's bit for bit (both run oneDNN); fp32 ones differ from MKL's in rounding only
(relative 1e-7), because the two libraries sum in other orders.

Small batches read the GGUF's own blocks: a weight loaded from a Q4_0/Q4_1/Q8_0/Q4_K GGUF tensor keeps its blocks
(engine.kernels.gguf_blocks.GGUFBlocks, 0.75 bytes per weight for Q4, 1.125 for Q8_0), and a decode step of at most
GGUF_KERNEL_MAX_ROWS rows multiplies by them in fp32 (engine.kernels.gguf_blocks.gguf_linear) instead of reading the
4-byte fp32 copy: at a few rows a decode step is bound by memory bandwidth, not FLOPs. The weights are the same
numbers bit for bit (the blocks' values are what the fp32 copy was dequantized from); only the fp32 summation order
differs, as it does between oneDNN kernels. More rows run the packed GEMM, faster once the step is compute-bound.

NOTE: oneDNN's packed GEMM gives a row the same bits whatever the other rows of the step (its per-output
reduction order does not depend on M), and a seeded request's tokens are reproducible because of it, "whatever else
is in the batch and after preemption" (SamplingParams.seed): a far-tail sample of the inverse CDF flips on a 1e-7
change of a logit. So the runner opens the small-batch kernel only around a decode-only step with no seeded row
(`gguf_kernel_scope`); prompts, and steps holding a seeded row, always run the packed GEMM. Outside such a scope
(perplexity, GPTQ, direct model calls) PackedLinear never uses it. One way remains for kernel-computed numbers to
reach a seeded row: a prompt that begins with text another request generated in this engine may take the KV blocks
those decode steps wrote from the prefix cache (a cold engine computes them with the packed GEMMs).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
from torch import nn

from engine.kernels import cpu_kernels
from engine.kernels.cpu_features import cpu_has_avx512
from engine.kernels.gguf_blocks import GGUFBlocks, gguf_linear
from schemas import settings

PACKED_DTYPES = (torch.float32, torch.bfloat16)
#: Rows M of a step up to which an fp32 PackedLinear with GGUF blocks runs engine.kernels.gguf_blocks.gguf_linear
#: instead of the packed GEMM (module docstring): the largest M at which `python -m bench.cpu_kernels --gguf` found
#: the kernel faster than the packed GEMM (bench/README.md "Small batches on the GGUF's own blocks").
#: TOKENMILL_GGUF_KERNEL=0 turns the small-batch kernel off (every step on the packed GEMM; gguf_kernel_max_rows).
GGUF_KERNEL_MAX_ROWS = 16

_scope = threading.local()  # engines on other threads (an EngineLoop's) step the same shared model


@contextlib.contextmanager
def gguf_kernel_scope(allowed: bool) -> Iterator[None]:
    """Let this thread's PackedLinear modules use their GGUF blocks for steps of <= GGUF_KERNEL_MAX_ROWS rows while
    the block runs (when `allowed`; module docstring NOTE says when the runner allows it). Never without the C++
    kernels (engine.kernels.cpu_kernels): gguf_linear's torch form dequantizes the whole weight per call, slower than
    the
    packed GEMM."""
    before = getattr(_scope, "max_rows", 0)
    _scope.max_rows = gguf_kernel_max_rows() if allowed and cpu_kernels.cpu_ops() is not None else 0
    try:
        yield
    finally:
        _scope.max_rows = before


def gguf_kernel_max_rows() -> int:
    """GGUF_KERNEL_MAX_ROWS, or 0 when TOKENMILL_GGUF_KERNEL=0 turns the small-batch kernel off (read now: the
    scope reads it once per step). Raises ValueError naming the variable for a value that is no switch."""
    return GGUF_KERNEL_MAX_ROWS if settings.env_flag(settings.GGUF_KERNEL) else 0


def packing_available() -> bool:
    """True when this torch build has oneDNN (mkldnn) and its prepacked linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def bf16_packing_available() -> bool:
    """True when oneDNN can pack bf16 weights on this CPU: its bf16 reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT
    (AVX2-only CPUs have neither; there bf16 linears stay plain nn.Linear). Found by packing a tiny weight once."""
    if not packing_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def can_pack(dtype: torch.dtype) -> bool:
    """True when a CPU weight of `dtype` can be packed: fp32 wherever oneDNN is, bf16 per bf16_packing_available."""
    if dtype == torch.bfloat16:
        return bf16_packing_available()
    return dtype in PACKED_DTYPES and packing_available()


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout and the bias b, when there is one, added in the GEMM's
    epilogue (oneDNN's bias post-op: one pass over y instead of a GEMM and an add; fp32 results are the same bits as
    the GEMM followed by the add, bf16 ones round once instead of twice).

    Args:
        weight: fp32 or bf16 [N, K] on the CPU (N = out_features, K = in_features); packed here, not kept.
        blocks: the same weight's GGUF blocks (fp32 weights only; module docstring), or None.
        bias: [N] (any float dtype: held in the weight's), or None.

    forward: x [..., K] of the weight's dtype -> [..., N]. `forward_gelu`: GELU (erf) of the same, fused too.

    Raises ValueError for another device or dtype, a bias of another shape, a torch without oneDNN
    (packing_available()), or bf16 on a CPU whose oneDNN cannot pack it (bf16_packing_available()), or blocks of
    another shape or with a bf16 weight.
    """

    def __init__(self, weight: torch.Tensor, blocks: GGUFBlocks | None = None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not packing_available():
            raise ValueError("PackedLinear needs torch built with oneDNN (mkldnn); keep the nn.Linear")
        if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
            raise ValueError(f"PackedLinear takes a 2-D fp32/bf16 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        if not can_pack(weight.dtype):
            raise ValueError("oneDNN cannot pack bf16 weights on this CPU (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT); "
                             "keep the nn.Linear, or run in float32")
        if blocks is not None and (blocks.shape != tuple(weight.shape) or weight.dtype != torch.float32):
            raise ValueError(f"GGUF blocks {blocks.shape} do not serve a {weight.dtype} weight "
                             f"{tuple(weight.shape)}; pass blocks=None")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"a bias of {tuple(bias.shape)} does not fit a weight of {tuple(weight.shape)}")
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.blocks = blocks
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)
        self.gelu_epilogue = cpu_has_avx512()  # forward_gelu's: the epilogue where it is the faster

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if (self.blocks is not None and x2.shape[0] <= getattr(_scope, "max_rows", 0)
                and x2.dtype == torch.float32):
            y = gguf_linear(x2, self.blocks)
            y = y if self.bias is None else y + self.bias
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """GELU (exact, erf: F.gelu's default) of forward(x), the activation in the GEMM's epilogue (oneDNN's
        gelu_erf post-op: fp32 results equal F.gelu(forward(x)) within rounding, bit for bit on the AVX512 EPYC it
        was measured on) where the CPU has AVX-512; without it (`gelu_epilogue` False) GELU runs in place after the
        GEMM: oneDNN's AVX2 gelu_erf epilogue made a [2048, 384] x [384, 1536] GEMM run at 95-103 GFLOP/s against
        122-139 for the GEMM and a separate GELU (AVX2-only AMD EPYC, 2 cores). x [..., K] -> [..., N]."""
        if self.blocks is not None or not self.gelu_epilogue:  # the small-batch GGUF path has no epilogue
            return torch.ops.aten.gelu_(self.forward(x))
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "gelu", [],
                                               "none")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        small = f", GGUF {self.blocks.type_name} blocks up to {GGUF_KERNEL_MAX_ROWS} rows" if self.blocks else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, "
                f"oneDNN packed{small}")

