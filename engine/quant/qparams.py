"""INT4 group-wise quantization parameters and the portable packed format (layer 1 of 3, after gpt-fast), and the
stored INT8 weight of a W8A8 checkpoint (Int8Weight; its kernel: engine.quant.int8_linear).

Convention (tinygemm, the kernel behind `torch.ops.aten._weight_int4pack_mm`): a weight row is cut into groups of
`group_size` consecutive input features; each group has a scale s and a zero z, and element q in 0..15 stands for

    w = (q - 8) * s + z

Asymmetric min-max quantization gives s = (max - min) / 15 and z = min + 8 * s. GGUF Q4_1 (w = d * q + m) is the
same grid with s = d, z = m + 8d; Q4_0 (w = d * (q - 8)) has s = d, z = 0. Sources: gpt-fast quantize.py
(`get_group_qparams`, `group_quantize_tensor`), torchao's TensorCoreTiledLayout, ggml docs (ggml-quants.c).

Portable format (what is saved to disk; device layouts are built from it at load time by engine.quant.int4_linear):
    qweight: uint8 [N, Kp / 2], byte j of a row holds element 2j in its high nibble and 2j + 1 in its low nibble
             (the order `_convert_weight_to_int4pack` takes since torch 2.5);
    scales, zeros: [N, Kp / group_size], bf16 on disk;
    Kp = K rounded up to a multiple of group_size; the padding columns quantize zeros and meet zero activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas.engine_choices import INT4_GROUP_SIZES

GROUP_SIZES = INT4_GROUP_SIZES  # schemas.engine_choices: EngineConfig and the job spec take the same


def padded_in_features(in_features: int, group_size: int) -> int:
    """K rounded up to a multiple of `group_size` (tinygemm needs whole groups; Kp is then a multiple of 32, which
    the CUDA pack op needs too). Raises ValueError for a group size tinygemm does not support."""
    check_group_size(group_size)
    return -(-in_features // group_size) * group_size


def check_group_size(group_size: int) -> None:
    """Raise ValueError unless `group_size` is one tinygemm supports (32, 64, 128, 256)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")


def pack_uint4(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values: q int [N, K] in 0..15 (K even) -> uint8 [N, K / 2], element 2j in the high nibble.

    Raises ValueError when K is odd."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_uint4 needs an even number of columns, got {q.shape[-1]}; pad K first")
    q = q.to(torch.uint8)
    return (q[..., ::2] << 4) | q[..., 1::2]


def unpack_uint4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_uint4`: uint8 [N, K / 2] -> uint8 [N, K] in 0..15."""
    return torch.stack((packed >> 4, packed & 15), dim=-1).flatten(-2)


@dataclass
class Int4Weight:
    """One linear (or embedding) weight in the portable INT4 format (see the module docstring).

    Attributes:
        qweight: uint8 [N, Kp / 2].
        scales, zeros: float [N, Kp / group_size] (bf16 on disk; fp32 when loaded from GGUF, so Q4 stays exact).
        in_features: K, the unpadded input width (Kp - K padding columns are ignored).
        group_size: input features per (scale, zero) group.
        in_perm: None, or int64 [K]: the input feature each column holds (column j multiplies x[..., in_perm[j]]):
            a GPTQ act-order checkpoint's columns sorted by group, so that its groups are contiguous runs
            (engine.loading.quant_groups). Int4Linear gathers x's features in this order before its GEMM.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    in_features: int
    group_size: int
    in_perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        kp = padded_in_features(self.in_features, self.group_size)
        n = self.qweight.shape[0]
        if self.qweight.dtype != torch.uint8 or tuple(self.qweight.shape) != (n, kp // 2):
            raise ValueError(f"qweight must be uint8 [{n}, {kp // 2}] for in_features {self.in_features} and group "
                             f"size {self.group_size}; got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        for name in ("scales", "zeros"):
            t = getattr(self, name)
            if tuple(t.shape) != (n, kp // self.group_size):
                raise ValueError(f"{name} must be [{n}, {kp // self.group_size}], got {tuple(t.shape)}")
        if self.in_perm is not None and (self.in_perm.dtype != torch.int64
                                         or tuple(self.in_perm.shape) != (self.in_features,)):
            raise ValueError(f"in_perm must be int64 [{self.in_features}], got {self.in_perm.dtype} "
                             f"{tuple(self.in_perm.shape)}")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def padded_in_features(self) -> int:
        return self.qweight.shape[1] * 2

    def to(self, device: torch.device | str | None = None, scale_dtype: torch.dtype | None = None) -> Int4Weight:
        """A copy on `device` with scales and zeros in `scale_dtype` (None keeps them)."""
        dt = scale_dtype or self.scales.dtype
        return Int4Weight(self.qweight.to(device), self.scales.to(device, dt), self.zeros.to(device, dt),
                          self.in_features, self.group_size,
                          None if self.in_perm is None else self.in_perm.to(device))

    def map_rows(self, fn: object) -> Int4Weight:
        """Apply a row permutation `fn(tensor) -> tensor` (e.g. loader.unpermute_rope_rows) to every part."""
        return Int4Weight(fn(self.qweight), fn(self.scales), fn(self.zeros), self.in_features,  # type: ignore[operator]
                          self.group_size, self.in_perm)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as `dtype` [N, K]: (q - 8) * scale + zero, computed in fp32 (padding columns dropped), its
        columns in the input's order (in_perm undone)."""
        n, g = self.out_features, self.group_size
        q = unpack_uint4(self.qweight).view(n, -1, g).float()
        w = ((q - 8) * self.scales.float()[..., None] + self.zeros.float()[..., None]).view(n, -1)[:, :self.in_features]
        if self.in_perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.in_perm.to(w.device), w)
        return w.to(dtype)


@dataclass
class Int8Weight:
    """A linear weight stored as INT8 per output channel, symmetric: W[n, k] = qweight[n, k] * scale[n] (a W8A8
    checkpoint's integers and scales as they are, e.g. compressed-tensors `int-quantized`).

    Attributes:
        qweight: int8 [N, K].
        scale: fp32 [N].
    Raises ValueError when the shapes or dtypes disagree.
    """

    qweight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if (self.qweight.dtype != torch.int8 or self.qweight.dim() != 2 or self.scale.dtype != torch.float32
                or tuple(self.scale.shape) != (self.qweight.shape[0],)):
            raise ValueError(f"Int8Weight takes int8 [N, K] and fp32 [N] scales, got {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)} and {self.scale.dtype} {tuple(self.scale.shape)}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as `dtype` [N, K]: q * scale in fp32."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)


def _mse_fit(wf: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, steps: int,
             importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (scale, min) minimizing the (importance-weighted) squared error, as llama.cpp's make_qkx2_quants:
    for each candidate inverse scale (15 + delta) / (max - min), delta in [-1, 1], round to q, then fit scale and
    min to q by weighted least squares; keep the best. wf: fp32 [N, G, g]; importance: fp32 >= 0 broadcastable to
    wf (e.g. [G, g], the mean squared activation of each input feature, as the weights of llama.cpp's imatrix
    quantization), None = uniform. Returns fp32 [N, G] twice; a group whose weights sum to zero keeps min-max."""
    # Uniform weights skip the products with c: multiplying by 1.0 is exact, so the result is the same bit for bit.
    c = None if importance is None else importance.expand_as(wf)  # a view, no [N, G, g] copy

    def weighted_error(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        q = ((wf - m[..., None]) / s[..., None]).round().clamp(0, 15)
        err = (wf - q * s[..., None] - m[..., None]) ** 2
        return (err if c is None else c * err).sum(-1)

    best_s, best_m = (hi - lo).clamp(min=1e-6) / 15, lo.clone()
    best_err = weighted_error(best_s, best_m)
    if c is None:
        sum_c, sum_cw = torch.full_like(lo, float(wf.shape[-1])), wf.sum(-1)
    else:
        sum_c, sum_cw = c.sum(-1), (c * wf).sum(-1)
    for delta in torch.linspace(-1.0, 1.0, steps).tolist():
        inv = (15 + delta) / (hi - lo).clamp(min=1e-6)
        q = ((wf - lo[..., None]) * inv[..., None]).round_().clamp_(0, 15)
        cq = q if c is None else c * q
        sum_cq, sum_cq2, sum_cqw = cq.sum(-1), (cq * q).sum(-1), (cq * wf).sum(-1)
        det = sum_c * sum_cq2 - sum_cq * sum_cq
        ok = det > 1e-9 * sum_c * sum_cq2
        s = torch.where(ok, (sum_c * sum_cqw - sum_cq * sum_cw) / det.clamp(min=1e-30), best_s).clamp(min=1e-8)
        m = torch.where(ok, (sum_cw - s * sum_cq) / sum_c.clamp(min=1e-30), best_m)
        err = weighted_error(s, m)
        better = err < best_err
        best_s, best_m, best_err = (torch.where(better, s, best_s), torch.where(better, m, best_m),
                                    torch.where(better, err, best_err))
    return best_s, best_m


#: Weights per `_mse_fit` call of quantize_int4 (whole rows): the fit's [rows, G, g] temporaries, a dozen per candidate
#: scale, stay in the CPU's cache. Each group's fit is its own, so the result is the same bit for bit (checked on every
#: weight of SmolLM2-135M at groups 32 and 128, one and two threads); fitted whole, its 49k x 576 embedding took 8x
#: the CPU time and the whole model 3x.
_MSE_CHUNK = 1 << 18


def quantize_int4(w: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype = torch.bfloat16,
                  method: str = "mse", mse_steps: int = 11) -> Int4Weight:
    """Asymmetric group-wise INT4 quantization of w: float [N, K] (gpt-fast `group_quantize_tensor`).

    method: "minmax" = scale (max - min) / 15 and min as in gpt-fast; "mse" (default) = the squared-error fit of
    `_mse_fit` (llama.cpp make_qkx2_quants): on SmolLM2-135M at group 128 it measured +51% perplexity against
    +72% for min-max (20k AlpacaEval tokens, bench/README.md). Scales and zeros are rounded to `scale_dtype`
    first and q is computed against the rounded values, so the stored (q, scale, zero) triple is the best for what
    the kernel will actually read. Groups of equal values get scale 1e-6 / 15 (gpt-fast's clamp).
    Raises ValueError for a bad group size or method, or a weight that is not 2-D.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_int4 takes a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if method not in ("minmax", "mse"):
        raise ValueError(f"method must be 'minmax' or 'mse', got {method!r}")
    n, k = w.shape
    kp = padded_in_features(k, group_size)
    wf = torch.nn.functional.pad(w.float(), (0, kp - k)).view(n, kp // group_size, group_size)
    lo, hi = wf.amin(-1), wf.amax(-1)
    if method == "mse":
        rows = max(1, _MSE_CHUNK // kp)
        fits = [_mse_fit(wf[i:i + rows], lo[i:i + rows], hi[i:i + rows], mse_steps) for i in range(0, n, rows)]
        s, lo = torch.cat([f[0] for f in fits]), torch.cat([f[1] for f in fits])
        scales = s.to(scale_dtype)
    else:
        scales = ((hi - lo).clamp(min=1e-6) / 15).to(scale_dtype)
    zeros = (lo + 8 * scales.float()).to(scale_dtype)
    lo_rounded = zeros.float() - 8 * scales.float()
    q = ((wf - lo_rounded[..., None]) / scales.float()[..., None]).round_().clamp_(0, 15)
    return Int4Weight(pack_uint4(q.view(n, kp)), scales, zeros, k, group_size)
