"""Group-wise integer weights read from a quantized checkpoint (GPTQ, AWQ, compressed-tensors), in one form, and
their two ways into the engine: the portable INT4 format as stored (no second quantization) or an exact dequantize.

Every format these loaders read stores a linear weight W [N, K] as unsigned integers q, a scale s and an integer
zero point z per (output row, group), and a group index per input feature:

    W[n, k] = (q[n, k] - z[n, g[k]]) * s[n, g[k]]

(GPTQ: Frantar et al., 2022, and AutoGPTQ's pack format; AWQ: Lin et al., 2023, AutoAWQ's GEMM format;
compressed-tensors' pack_quantized and naive_quantized compressors, whose signed integers shift by 2^(bits-1) into
this unsigned form, the difference q - z unchanged).

Mapping to the tinygemm convention of engine.quant.qparams, w = (q - 8) * s' + z', is exact with s' = s and
z' = (8 - z) * s: both products are exact in fp32 when s has at most 20 significant bits (fp16 and bf16 scales
always do: |q - 8| and |8 - z| are at most 16), and then the sums the kernels compute, (q - 8) * s + (8 - z) * s
and q * s + (-z * s), are the exact (q - z) * s, which needs at most 24 bits. Groups must be contiguous runs of a
size tinygemm takes (32..256); a larger group (e.g. per channel, one group of K) is cut into groups of such a size
that share its scale and zero. Act-order group indices (GPTQ desc_act: feature k in group g[k], groups not runs)
become runs by sorting the input features by group once at load: the INT4 weight holds the checkpoint's columns in
that order (Int4Weight.in_perm) and Int4Linear gathers x's features alike, so sum_k x[k] W[n, k] is the same sum
in another order (exact weights; the float sum may round differently). Where any of this fails (8 bits, a group
size tinygemm cannot hold, fp32 scales with more bits) the layer is dequantized exactly (fp32 arithmetic on exact
values) instead. An 8-bit per-channel symmetric layer of a W8A8 checkpoint goes to the INT8 kernel with its
integers as stored (to_int8) where the CPU's int8 GEMM sums them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.qparams import GROUP_SIZES, Int4Weight, Int8Weight, pack_uint4, padded_in_features


@dataclass
class IntGroupWeight:
    """One linear weight as a checkpoint stores it, unpacked (module docstring).

    Attributes:
        q: int16 [N, K], unsigned values 0 .. 2^bits - 1.
        zeros: int16 [N, G], the zero point of each (row, group), same offset as q (may lie outside q's range:
            GPTQ v1 reads 1 .. 2^bits).
        scales: float [N, G] in the checkpoint's dtype (fp16, bf16 or fp32).
        g_idx: int64 [K], the group of each input feature (k // group_size unless act-order reordered them).
        bits: 4 or 8.
    """

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bits: int

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [N, K]: (q - z) * s with exact integer differences and one fp32 rounding of the product (no
        rounding at all for fp16/bf16 scales)."""
        diff = (self.q.to(torch.int32) - self.zeros.to(torch.int32)[:, self.g_idx]).float()
        return diff * self.scales.float()[:, self.g_idx]

    def contiguous_group_size(self) -> int | None:
        """G when g_idx is the plain grouping k // G (the last group may be short), else None (act-order)."""
        k = self.g_idx.numel()
        n_groups = self.scales.shape[1]
        size = -(-k // n_groups)
        expected = torch.arange(k, device=self.g_idx.device) // size
        return size if torch.equal(self.g_idx.to(torch.int64), expected) else None

    def act_order_perm(self) -> torch.Tensor | None:
        """int64 [K]: the input features sorted by group (stable), when that makes the groups contiguous runs
        (GPTQ act-order: g_idx[perm[i]] = i // group_size); None when g_idx already is plain or no order does."""
        if self.contiguous_group_size() is not None:
            return None
        perm = torch.argsort(self.g_idx, stable=True)
        return perm if self.permuted(perm).contiguous_group_size() is not None else None

    def permuted(self, perm: torch.Tensor) -> IntGroupWeight:
        """The same weight with its input features (columns of q, entries of g_idx) in the order `perm`."""
        return IntGroupWeight(self.q[:, perm], self.zeros, self.scales, self.g_idx[perm], self.bits)

    def int4_plan(self, act_order: bool = True) -> tuple[int | None, torch.Tensor | None, str]:
        """(tinygemm group size, input order or None, "") when this weight maps to Int4Weight exactly, else (None,
        None, why not). With `act_order`, act-order group indices are made contiguous by an input order
        (act_order_perm): the weight's columns are the checkpoint's, reordered; Int4Linear reorders x alike."""
        if self.bits != 4:
            return None, None, f"{self.bits}-bit weights (the INT4 kernels hold 4 bits)"
        perm = self.act_order_perm() if act_order else None
        weight = self if perm is None else self.permuted(perm)
        group = weight.contiguous_group_size()
        if group is None:
            return None, None, "act-order group indices (g_idx) that are not contiguous groups"
        k = self.q.shape[1]
        sizes = [g for g in (128, 256, 64, 32) if g in GROUP_SIZES and group % g == 0]
        if not sizes and group == k:
            sizes = [128]  # one group per row: cut into padded groups of 128 that share its scale and zero
        if not sizes:
            return None, None, f"group size {group} (tinygemm takes {GROUP_SIZES} or multiples)"
        if not scales_exact_in_fp32(self.scales):
            return None, None, "fp32 scales with more than 20 significant bits ((q - 8) * s would round)"
        return sizes[0], perm, ""

    def to_int4(self, group_size: int, perm: torch.Tensor | None = None) -> Int4Weight:
        """The portable INT4 weight of group `group_size` (from int4_plan) with fp32 scales and zeros z' = (8 - z) * s
        (exact: module docstring), its columns in the order `perm` (int4_plan's; then Int4Weight.in_perm).
        Padding columns hold q = 8 and meet zero activations."""
        if perm is not None:
            out = self.permuted(perm).to_int4(group_size)
            out.in_perm = perm.to(torch.int64)
            return out
        n, k = self.q.shape
        kp = padded_in_features(k, group_size)
        n_groups = kp // group_size
        # each tinygemm group takes the scale and zero of the checkpoint group its first feature falls in
        src = self.g_idx[torch.arange(n_groups) * group_size]
        scales = self.scales.float()[:, src]
        zeros = (8 - self.zeros.to(torch.int32)[:, src]).float() * scales
        q = torch.nn.functional.pad(self.q, (0, kp - k), value=8)
        return Int4Weight(pack_uint4(q), scales, zeros, k, group_size)

    def to_int8(self, qmax: float) -> tuple[Int8Weight | None, str]:
        """(Int8Weight with the stored integers, "") for an 8-bit symmetric per-channel weight whose signed values
        fit |q| <= qmax (engine.quant.int8_linear.int8_weight_qmax), else (None, why not). Exact: W = q * s with s
        the checkpoint's scale in fp32."""
        if self.bits != 8 or self.scales.shape[1] != 1:
            return None, (f"{self.bits}-bit weights with {self.scales.shape[1]} groups per row (INT8 takes one "
                          "scale per row)")
        if not bool((self.zeros == 128).all()):
            return None, "asymmetric int8 weights (the INT8 kernel takes zero points of 0)"
        signed = self.q.to(torch.int16) - 128
        top = int(signed.abs().max()) if signed.numel() else 0
        if top > qmax:
            return None, f"int8 weights beyond this CPU's INT8 limit (|q| <= {int(qmax)} without VNNI)"
        return Int8Weight(signed.to(torch.int8), self.scales.float().reshape(-1).contiguous()), ""


def scales_exact_in_fp32(scales: torch.Tensor) -> bool:
    """True when every scale has at most 20 significant bits (fp16/bf16 always; fp32 only with its low 4 mantissa
    bits zero), so that s times an integer of magnitude <= 16 is exact in fp32."""
    if scales.dtype in (torch.float16, torch.bfloat16):
        return True
    bits = scales.float().contiguous().view(torch.int32)
    return bool(((bits & 0xF) == 0).all())


def plain_group_index(in_features: int, group_size: int) -> torch.Tensor:
    """int64 [K]: k // group_size (group_size <= 0: one group, GPTQ's -1)."""
    size = in_features if group_size <= 0 else group_size
    return torch.arange(in_features) // size
