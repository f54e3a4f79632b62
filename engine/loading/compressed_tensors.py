"""compressed-tensors checkpoints (what llm-compressor writes: `quant_method: compressed-tensors`), the formats
tokenmill reads: their config checked and each quantized linear layer read as IntGroupWeight or an exact fp32 weight.

Format (the compressed-tensors package, compressors/pack_quantized and naive_quantized, and its QuantizationArgs):
    pack-quantized   X.weight_packed int32 [N, ceil(K * bits / 32)]: element k at bits [k * bits, (k + 1) * bits) of
                     the row's bit string (4 bits: word k // 8, nibble k % 8), stored as q + 2^(bits-1) (q signed);
                     X.weight_scale [N, G] (group) or [N, 1] (channel); X.weight_shape int [2] = (N, K);
                     asymmetric: X.weight_zero_point packed the same way along the outputs, [ceil(N * bits / 32), G];
                     act-order "group": X.weight_g_idx int [K].
    int-quantized    X.weight int8 [N, K] (signed), X.weight_scale, X.weight_zero_point (asymmetric)
    float-quantized  X.weight float8_e4m3fn [N, K], X.weight_scale (tensor [1], channel [N, 1] or block
                     [ceil(N / bh), ceil(K / bw)])
    W[n, k] = (q - z) * s per the weights' strategy (tensor, channel, group, block).
Which scheme a layer has comes from config_groups (targets: a class name such as "Linear", a module name, or
"re:<regex>" matched from the start of the name) minus `ignore`. Imports torch only in the readers (the CLI's
preflight parses the config).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.loading.gptq_awq import GetTensor
    from engine.loading.quant_groups import IntGroupWeight

FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
_STRATEGIES = {"int": ("tensor", "channel", "group"), "float": ("tensor", "channel", "block")}


@dataclass
class CTScheme:
    """The weights' quantization of one config group (compressed-tensors QuantizationArgs, the fields we read)."""

    targets: list[str]
    format: str
    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None
    activations: dict[str, Any] | None

    def w8a8_dynamic(self) -> bool:
        """True for int8 weights per channel, symmetric, with int8 activations quantized per token, symmetric and
        dynamic: engine.quant.int8_linear's scheme."""
        a = self.activations or {}
        return (self.type == "int" and self.num_bits == 8 and self.symmetric and self.strategy == "channel"
                and a.get("type") == "int" and a.get("num_bits") == 8 and a.get("symmetric", True)
                and a.get("strategy") == "token" and a.get("dynamic") is True)


def parse_ct_config(q: dict[str, Any], source: str) -> tuple[list[CTScheme], list[str]]:
    """(schemes, ignore list) of a compressed-tensors quantization_config. Raises ValueError, naming the field, for
    anything tokenmill does not read exactly (other formats, sparsity, transforms, a quantized KV cache, output
    activations, weight strategies or bit widths it does not hold)."""
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if q.get(field):
            raise ValueError(f"{source}: quantization_config.{field} is set; tokenmill reads compressed-tensors "
                             "weight quantization only (no sparsity, transforms or quantized KV cache)")
    status = q.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise ValueError(f"{source}: quantization_config.quantization_status is {status!r}; tokenmill reads "
                         "compressed checkpoints (save them with llm-compressor's save_compressed=True)")
    default_format = q.get("format", "pack-quantized")
    schemes = []
    for name, group in (q.get("config_groups") or {}).items():
        fmt = group.get("format") or default_format
        w = group.get("weights")
        where = f"{source}: quantization_config.config_groups.{name}"
        if fmt == "dense" or w is None:
            continue
        if fmt not in FORMATS:
            raise ValueError(f"{where} has format {fmt!r}; tokenmill reads {FORMATS}")
        if group.get("output_activations"):
            raise ValueError(f"{where} quantizes output activations; tokenmill does not")
        typ, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 8)), w.get("strategy", "tensor")
        if typ not in _STRATEGIES or strategy not in _STRATEGIES[typ]:
            raise ValueError(f"{where}.weights: {typ} weights with strategy {strategy!r} are not read by tokenmill "
                             f"(int: {_STRATEGIES['int']}, float: {_STRATEGIES['float']})")
        if (typ, bits) not in (("int", 4), ("int", 8), ("float", 8)) or (typ == "float" and fmt == "pack-quantized"):
            raise ValueError(f"{where}.weights: {bits}-bit {typ} weights in {fmt!r} are not read by tokenmill "
                             "(int4/int8 pack-quantized, int8 int-quantized, fp8 float-quantized)")
        if typ == "float" and not w.get("symmetric", True):
            raise ValueError(f"{where}.weights: asymmetric fp8 weights are not read by tokenmill")
        block = w.get("block_structure")
        schemes.append(CTScheme(list(group.get("targets") or []), fmt, bits, typ, bool(w.get("symmetric", True)),
                                strategy, w.get("group_size"), tuple(block) if block else None,
                                group.get("input_activations")))
    return schemes, list(q.get("ignore") or [])


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


def scheme_for(module: str, schemes: list[CTScheme], ignore: list[str]) -> CTScheme | None:
    """The scheme of the linear module `module` (checkpoint name, e.g. "model.layers.0.mlp.up_proj"), None when
    ignored or targeted by no group."""
    if any(_matches(t, module) and t != "Linear" for t in ignore):
        return None
    return next((s for s in schemes if any(_matches(t, module) for t in s.targets)), None)


def _expand_scales(scale: torch.Tensor, n: int, k: int, scheme: CTScheme) -> torch.Tensor:
    """Scales per (row, group) [N, G] for tensor/channel/group strategies."""
    if scheme.strategy == "tensor":
        return scale.reshape(1, 1).expand(n, 1)
    return scale.reshape(n, -1)


def read_ct_int(get: GetTensor, prefix: str, scheme: CTScheme) -> IntGroupWeight:
    """A pack-quantized or int-quantized layer as IntGroupWeight (unsigned: signed values + 2^(bits-1)).
    Raises ValueError for a missing tensor or disagreeing shapes."""
    import torch

    from engine.loading.gptq_awq import unpack_int32
    from engine.loading.quant_groups import IntGroupWeight, plain_group_index

    bits, offset = scheme.num_bits, 1 << (scheme.num_bits - 1)
    scale = get(f"{prefix}.weight_scale")
    if scale is None:
        raise ValueError(f"checkpoint lacks {prefix}.weight_scale")
    packed = get(f"{prefix}.weight_packed")
    if packed is not None:
        shape = get(f"{prefix}.weight_shape")
        if shape is None:
            raise ValueError(f"checkpoint lacks {prefix}.weight_shape")
        n, k = (int(v) for v in shape.tolist())
        q = unpack_int32(packed, bits).reshape(packed.shape[0], -1)[:, :k]
    else:
        w = get(f"{prefix}.weight")
        if w is None or w.dtype != torch.int8:
            raise ValueError(f"{prefix}.weight must be int8 in an int-quantized checkpoint")
        n, k = w.shape
        q = w.to(torch.int16) + offset
    scales = _expand_scales(scale, n, k, scheme)
    zp = get(f"{prefix}.weight_zero_point")
    if scheme.symmetric or zp is None:
        zeros = torch.full(scales.shape, offset, dtype=torch.int16)
    elif zp.dtype == torch.int32:  # packed along the outputs
        zeros = unpack_int32(zp.t().contiguous(), bits).reshape(zp.shape[1], -1)[:, :n].t().contiguous()
    else:
        zeros = (zp.to(torch.int16) + offset).reshape(-1, 1).expand(scales.shape) if zp.numel() == 1 else (
            zp.to(torch.int16).reshape(scales.shape) + offset)
    g_idx = get(f"{prefix}.weight_g_idx")
    if g_idx is None:
        group = k if scheme.strategy != "group" else int(scheme.group_size or k)
        g_idx = plain_group_index(k, group)
    g_idx = g_idx.to(torch.int64)
    if q.shape != (n, k) or zeros.shape != scales.shape or int(g_idx.max()) >= scales.shape[1]:
        raise ValueError(f"{prefix}: weight {tuple(q.shape)}, scales {tuple(scales.shape)} and zero points "
                         f"{tuple(zeros.shape)} do not agree with weight_shape ({n}, {k})")
    return IntGroupWeight(q.contiguous(), zeros.contiguous(), scales.contiguous(), g_idx, bits)


def read_ct_float(get: GetTensor, prefix: str, scheme: CTScheme) -> torch.Tensor:
    """A float-quantized (fp8) layer dequantized exactly: fp32 [N, K] = w * s (fp8 times the scale, one fp32
    rounding; none for bf16/fp16 scales). Raises ValueError for a missing tensor or a bad scale shape."""
    w, scale = get(f"{prefix}.weight"), get(f"{prefix}.weight_scale")
    if w is None or scale is None or w.dim() != 2:
        raise ValueError(f"checkpoint lacks {prefix}.weight or .weight_scale of its fp8 layer")
    n, k = w.shape
    s = scale.float()
    if scheme.strategy == "block":
        bh, bw = scheme.block or (128, 128)
        s = s.reshape(-(-n // bh), -(-k // bw)).repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:n, :k]
    elif scheme.strategy == "channel":
        s = s.reshape(n, 1)
    else:
        s = s.reshape(1, 1)
    return w.float() * s
