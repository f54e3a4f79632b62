"""Thin INT4 modules (layer 3 of 3, after gpt-fast's WeightOnlyInt4Linear): the weight is packed to the device
layout once, at construction, and each forward picks a kernel by the number of rows M.

Kernels (torch 2.13; schemas `_convert_weight_to_int4pack[_for_cpu](Tensor self, int innerKTiles)` and
`_weight_int4pack_mm[_for_cpu](Tensor self, Tensor mat2, int qGroupSize, Tensor qScaleAndZeros)`):
- CUDA, bf16/fp16 activations, gemlite installed (the default): tinygemm for M <= tinygemm_max_rows
  (CUDA_TINYGEMM_MAX_ROWS; the thresholds and which kernel serves which M: engine.quant.int4_kernel_plan),
  GemLite's A16W4 Triton kernels above (engine.quant.gemlite_int4: the layout mapping,
  why GemLite, and its kernel configs), and from dequant_min_rows (CUDA_GEMLITE_DEQUANT_MIN_ROWS: long prefill
  chunks) GemLite's packed weight dequantized to the activation dtype and the dense GEMM. Two packed copies (0.5
  byte per weight each) while tinygemm is kept (layout "dual"); layout "single" (or tinygemm_max_rows=0) drops it
  and GemLite serves every M below dequant_min_rows (the dequantize path reads GemLite's copy). The engine picks
  the layout per model: engine.worker.memory_fit.choose_int4_layout. GemLite's configs are tuned and its kernels
  compiled at engine load (prepare_int4_kernels), not in the first steps. Without gemlite (or too old) a warning is
  logged once and the scheme below serves; gemlite=True makes that an ImportError instead.
- CUDA without gemlite (or fp32 activations, or gemlite=False), M < dequant_min_rows: tinygemm
  `_weight_int4pack_mm`. Takes bf16 activations only (others are cast in and back out), the weight from
  `_convert_weight_to_int4pack(uint8 [N, Kp/2], innerKTiles)` (int32 [N/8, Kp/(16*innerKTiles), 32,
  innerKTiles/2]) and scales_and_zeros bf16 [Kp/G, N, 2] ([..., 0] = scale, [..., 1] = zero), group size
  32/64/128/256.
- CUDA without gemlite, M >= dequant_min_rows: dequantize the portable copy to bf16 and call the dense GEMM;
  tinygemm is built for small M and falls far behind tensor-core GEMMs at large M (torchao's hqq README: 4.6x
  slower than a fused dequant GEMM at M=512 on an A6000). Costs a second copy (0.5 byte per weight);
  dequant_min_rows=None (or layout "single") drops it.
- CPU, bf16 activations: `_weight_int4pack_mm_for_cpu`, whose pack op takes int32 [N, Kp] (not uint8) and whose
  scales_and_zeros must have the activations' dtype. Faster than the fp32 GEMM (bench/README.md "INT4": CPU
  kernels).
- CPU, fp32/fp16 activations: dequantize-then-GEMM in that dtype. The fp32 variant of the CPU op is a slow path
  (far slower than its bf16 twin: bench/README.md "INT4", CPU kernels) and bf16 activations would
  cost the fp32 path its precision, so fp32 stays exact: w = (q - 8) * s + z in fp32.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.moe import GroupedExperts
from engine.quant.gemlite_int4 import GEMLITE_DTYPES, GemLiteInt4, gemlite_unavailable_reason
from engine.quant.gemlite_tuning import GemLiteTuning
from engine.quant.int4_kernel_plan import cuda_kernel_plan, gemlite_kernel_for
from engine.quant.qparams import Int4Weight, unpack_uint4

log = logging.getLogger(__name__)


def prepare_int4_kernels(model: nn.Module, max_rows: int, *, cache: Path | None | str = "auto",
                         autotune: str | None = None) -> GemLiteTuning | None:
    """Tune and compile the GemLite kernels of `model`'s Int4Linear modules for every row count M in 1..max_rows
    that GemLite serves (engine.quant.gemlite_tuning.tune_gemlite: configs loaded or autotuned once per GPU model and
    cached on disk). The engine calls it at load with max_rows = max(max_num_batched_tokens, max_num_seqs), which
    covers its CUDA-graph batch sizes and prefill chunks. Returns what was done, or None when no module runs
    GemLite (CPU, fp32, gemlite missing). cache and autotune: as tune_gemlite ("auto" / its default mode)."""
    from engine.quant.gemlite_tuning import GEMLITE_AUTOTUNE, tune_gemlite

    mods = [m for m in model.modules() if isinstance(m, Int4Linear) and m.gemlite is not None]
    if not mods:
        return None
    owner = {id(m.gemlite): m for m in mods}
    return tune_gemlite([m.gemlite for m in mods], range(1, max_rows + 1),
                        lambda g, rows: owner[id(g)].kernel_for(rows) == "gemlite", cache=cache,
                        autotune=autotune or GEMLITE_AUTOTUNE)


def _inner_k_tiles(kp: int) -> int:
    """Largest innerKTiles (8, 4, 2) with Kp a multiple of 16 * innerKTiles (Kp is a multiple of 32)."""
    return next(t for t in (8, 4, 2) if kp % (16 * t) == 0)


def scales_and_zeros(weight: Int4Weight, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """tinygemm's qScaleAndZeros: `dtype` [Kp / G, N, 2] with [..., 0] = scale and [..., 1] = zero (gpt-fast), on
    `device` (default: the weight's; only the scales and zeros move there)."""
    s, z = weight.scales.to(device), weight.zeros.to(device)
    return torch.stack((s, z), dim=-1).transpose(0, 1).contiguous().to(dtype)


class _Dequantizer:
    """Portable weight kept for dequantize-then-GEMM: uint8 [N, Kp/2] plus scale and min = zero - 8 * scale per
    group ([N, Kp/G], in the compute dtype), so w = q * scale + min is one fused multiply-add."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device) -> None:
        self.qweight = weight.qweight.to(device)
        self.scales = weight.scales.to(device, torch.float32)
        self.mins = (weight.zeros.to(device, torch.float32) - 8 * self.scales).to(dtype)
        self.scales = self.scales.to(dtype)
        self.group_size = weight.group_size

    def rows(self, index: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `index` (all rows when None): dtype [R, Kp]."""
        q, s, m = self.qweight, self.scales, self.mins
        if index is not None:
            q, s, m = q[index], s[index], m[index]
        r = q.shape[0]
        w = unpack_uint4(q).view(r, -1, self.group_size).to(dtype)
        return torch.addcmul(m[..., None].to(dtype), w, s[..., None].to(dtype)).view(r, -1)


class Int4Linear(nn.Module):
    """y = x W^T with W stored as INT4 (W4A16, group-wise, no bias).

    Args:
        weight: the portable INT4 weight (engine.quant.qparams.Int4Weight), N = out_features, K = in_features.
        dtype: the activations' dtype (fp32, bf16 or fp16); output has the input's dtype.
        device: where the packed weight lives.
        dequant_min_rows: on CUDA, rows M at and above which to dequantize and use the dense GEMM; None = never
            (without GemLite: always tinygemm, and no second copy). Ignored on CPU (see the module docstring).
            "auto" = CUDA_GEMLITE_DEQUANT_MIN_ROWS with GemLite, CUDA_DEQUANT_MIN_ROWS without.
        gemlite: on CUDA, None = GemLite above tinygemm_max_rows when installed (else a logged fallback), True =
            required, False = never (see cuda_kernel_plan). Ignored on CPU.
        tinygemm_max_rows: on CUDA with GemLite, rows M up to which tinygemm serves; "auto" =
            CUDA_TINYGEMM_MAX_ROWS, 0 = GemLite at every M (one packed copy).
        layout: on CUDA, "dual" (the kernels above) or "single" (one packed copy: cuda_kernel_plan). Ignored on CPU.
    `source` is the portable weight, kept (on the host, as given) for concat until release_source(): the engine
    releases it once the projections are fused (release_int4_sources), so only the packed forms stay.
    forward: x [..., K] -> [..., N] (with the weight's in_perm, x's features gathered in that order first: one
    index_select). Raises ValueError on construction for a device other than cpu/cuda, and as cuda_kernel_plan.
    """

    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device | str,
                 dequant_min_rows: int | None | str = "auto", *, gemlite: bool | None = None,
                 tinygemm_max_rows: int | None | str = "auto", layout: str = "dual") -> None:
        super().__init__()
        device = torch.device(device)
        self.source: Int4Weight | None = weight
        self.dtype, self.device, self.dequant_min_rows_arg = dtype, device, dequant_min_rows
        self.gemlite_arg, self.tinygemm_max_rows_arg, self.layout = gemlite, tinygemm_max_rows, layout
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.padded_in_features, self.group_size = weight.padded_in_features, weight.group_size
        self.in_perm = None if weight.in_perm is None else weight.in_perm.to(device)  # act-order: x's features
        self.packed: torch.Tensor | None = None
        self.scales_and_zeros: torch.Tensor | None = None
        self.dequantizer: _Dequantizer | None = None
        self.gemlite: GemLiteInt4 | None = None
        self.dequant_min_rows: int | None = 0
        self.tinygemm_max_rows = 0
        if device.type == "cpu":
            if dtype == torch.bfloat16:
                q = unpack_uint4(weight.qweight).to(torch.int32)
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
                self.scales_and_zeros = scales_and_zeros(weight, torch.bfloat16)
                self.dequant_min_rows = None
            else:
                self.dequantizer = _Dequantizer(weight, dtype, device)
        elif device.type == "cuda":
            use_gemlite, tiny_rows, rows = cuda_kernel_plan(
                dtype, weight.out_features, tinygemm_max_rows, dequant_min_rows, gemlite,
                None if gemlite is False or dtype not in GEMLITE_DTYPES else gemlite_unavailable_reason(), layout)
            if use_gemlite:
                self.gemlite = GemLiteInt4(weight, dtype, device)
                self.tinygemm_max_rows, self.dequant_min_rows = tiny_rows, rows
            if (tiny_rows if use_gemlite else rows != 0):
                qw = weight.qweight.to(device).contiguous()
                self.packed = torch.ops.aten._convert_weight_to_int4pack(qw, _inner_k_tiles(self.padded_in_features))
                self.scales_and_zeros = scales_and_zeros(weight, torch.bfloat16, device)
            if not use_gemlite:
                if rows is not None:
                    self.dequantizer = _Dequantizer(weight, dtype, device)
                self.dequant_min_rows = rows
        else:
            raise ValueError(f"Int4Linear runs on cpu or cuda, not {device.type}; load the model with device=cpu")

    @classmethod
    def concat(cls, modules: list[Int4Linear]) -> Int4Linear | None:
        """One Int4Linear whose output is the concatenation of `modules`' outputs (their weights stacked along N,
        as engine.layers.linear.concat_linears asks), or None when their input width, group size, scale dtype,
        activation dtype, device, layout or input order (in_perm) differ, or when one has released its source. The
        portable weights are joined where they are (the host, as loaded): no device copy of them. The originals
        are not changed."""
        first = modules[0]
        srcs = [m.source for m in modules]
        if any(s is None for s in srcs) or any(m.layout != first.layout for m in modules):
            return None
        if any((s.in_features, s.group_size, s.scales.dtype) != (first.source.in_features, first.source.group_size,
                                                                  first.source.scales.dtype) for s in srcs) or any(
                (m.dtype, m.device) != (first.dtype, first.device) for m in modules) or not _same_order(srcs):
            return None
        where = first.source.qweight.device
        weight = Int4Weight(*(torch.cat([getattr(s, part).to(where) for s in srcs])
                              for part in ("qweight", "scales", "zeros")), first.in_features, first.group_size,
                            first.source.in_perm)
        return cls(weight, first.dtype, first.device, first.dequant_min_rows_arg, gemlite=first.gemlite_arg,
                   tinygemm_max_rows=first.tinygemm_max_rows_arg, layout=first.layout)

    def release_source(self) -> None:
        """Drop the portable weight (`source`): the packed forms serve every forward; concat refuses afterwards."""
        self.source = None

    def kernel_for(self, m: int) -> str:
        """"tinygemm", "gemlite" or "dequant": the kernel a forward with `m` rows will use."""
        if self.gemlite is not None:
            return gemlite_kernel_for(m, self.tinygemm_max_rows if self.packed is not None else 0,
                                      self.dequant_min_rows)
        if self.dequantizer is not None and (self.packed is None or (self.dequant_min_rows is not None
                                                                     and m >= self.dequant_min_rows)):
            return "dequant"
        return "tinygemm"

    def _tinygemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.in_perm is not None:
            x2 = x2.index_select(1, self.in_perm)
        if self.padded_in_features != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
        kernel = self.kernel_for(x2.shape[0])
        if kernel == "gemlite":
            y = self.gemlite(x2.to(self.dtype).contiguous()).to(x.dtype)
        elif kernel == "dequant" and self.gemlite is not None:
            y = F.linear(x2.to(self.dtype), self.gemlite.dequantize()).to(x.dtype)
        elif kernel == "dequant":
            y = F.linear(x2, self.dequantizer.rows(None, x.dtype))
        else:
            y = self._tinygemm(x2.to(torch.bfloat16)).to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kept = (("tinygemm", self.packed), ("gemlite", self.gemlite), ("dequant", self.dequantizer))
        k = "+".join(name for name, obj in kept if obj is not None)
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"layout={self.layout}, kernel={k}, dequant_min_rows={self.dequant_min_rows}, "
                f"tinygemm_max_rows={self.tinygemm_max_rows}")


def release_int4_sources(model: nn.Module) -> int:
    """Release the portable weight of every Int4Linear of `model` (Int4Linear.release_source), once its
    projections are fused: 0.5 byte per weight plus scales and zeros of host memory each (about 37 GB for a 70B);
    and the stacked INT4 weights of its CPU expert blocks (GroupedExperts.int4: the CPU has no grouped INT4 kernel;
    each expert's Int4Linear holds what it reads; CUDA blocks keep theirs, engine.quant.experts). Returns how many
    Int4Linear were released."""
    mods = [m for m in model.modules() if isinstance(m, Int4Linear) and m.source is not None]
    for m in mods:
        m.release_source()
    for m in model.modules():
        if isinstance(m, GroupedExperts) and m.int4 is not None and any(
                w is not None and w.qweight.device.type == "cpu" for w in m.int4):
            m.int4 = None
    return len(mods)


def _same_order(weights: list[Int4Weight]) -> bool:
    """True when every weight takes its input in the same order (no in_perm, or equal ones)."""
    perms = [w.in_perm for w in weights]
    if all(p is None for p in perms):
        return True
    return all(p is not None and torch.equal(p, perms[0]) for p in perms)


class Int4Embedding(nn.Module):
    """Token embedding stored as INT4: forward gathers the packed rows of `input_ids` and dequantizes them.

    weight: Int4Weight [vocab, hidden]; forward: int64 [T] -> dtype [T, hidden]. Used when the embedding is tied to
    the LM head, so the one INT4 tensor on disk serves both (the LM head gets its own Int4Linear).
    """

    def __init__(self, weight: Int4Weight, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if weight.in_perm is not None:
            raise ValueError("an INT4 embedding cannot hold permuted columns (in_perm); dequantize it")
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = dtype
        self.dequantizer = _Dequantizer(weight, torch.float32, torch.device(device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.dequantizer.rows(input_ids.reshape(-1), torch.float32)[:, :self.embedding_dim].to(
            self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.dequantizer.group_size}"
