"""Hugging Face folders whose config.json has a `quantization_config`: which methods tokenmill reads, the refusals
of everything else, and the state dict of such a folder, its layers kept as stored INT4 or dequantized exactly.

Methods read (engine.loading.gptq_awq, engine.loading.compressed_tensors; the arithmetic: engine.loading.quant_groups):
    gptq                4 or 8 bits, any group size (-1 = per channel), sym or asym, desc_act (g_idx), checkpoint
                        format v1 (zeros stored minus 1, the default) or gptq_v2
    awq                 version gemm, 4 bits, zero points
    compressed-tensors  pack-quantized int4/int8 (group or channel, sym or asym), int-quantized int8, float-quantized
                        fp8 (tensor, channel or block scales)
A layer goes to the INT4 kernels with its integers and scales as stored when that is exact
(IntGroupWeight.int4_plan), else it is dequantized exactly; `QuantReport` says which layers took which way and why.
Imports nothing of engine.loading.hf_folder (which imports this module), and torch only where tensors are read: the
CLI's preflight checks a folder's config and tensor names through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.loading.compressed_tensors import CTScheme, parse_ct_config, scheme_for

if TYPE_CHECKING:
    import torch

    from engine.loading.quant_groups import IntGroupWeight

SUPPORTED_METHODS = ("gptq", "awq", "compressed-tensors")
#: Tensor suffixes of a quantized linear layer, per method; the module's name is what precedes them.
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_CT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale",
             "input_zero_point")
_GPTQ_MARKERS = (".qweight", ".qzeros", ".g_idx")


@dataclass
class QuantFormat:
    """A folder's quantization_config, checked: the method and what its layers need to be read."""

    method: str
    bits: int = 4
    group_size: int = 128
    v1_zeros: bool = True  # GPTQ checkpoint format v1: zeros stored minus 1
    schemes: list[CTScheme] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for logs and summaries, e.g. "gptq 4-bit, group 128"."""
        if self.method == "compressed-tensors":
            return "compressed-tensors " + ", ".join(sorted({f"{s.format} {s.type}{s.num_bits} {s.strategy}"
                                                             for s in self.schemes}))
        group = "per channel" if self.group_size <= 0 else f"group {self.group_size}"
        return f"{self.method} {self.bits}-bit, {group}"


def read_quant_format(config: dict[str, Any], source: str) -> QuantFormat | None:
    """The checked quantization of an HF config.json (None when it has no quantization_config). Raises ValueError,
    one line naming the field and what tokenmill reads, for an unsupported method, bit width or layout."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"{source}: quantization_config.quant_method is {q.get('quant_method')!r}, which tokenmill "
                         f"does not read; supported: {', '.join(SUPPORTED_METHODS)} (or give the unquantized model)")
    if method == "compressed-tensors":
        schemes, ignore = parse_ct_config(q, source)
        return QuantFormat(method, schemes=schemes, ignore=ignore)
    bits, group = int(q.get("bits", 4)), int(q.get("group_size", 128))
    if method == "gptq":
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{source}: GPTQ with bits={bits} and checkpoint_format={fmt!r} is not read by "
                             "tokenmill; it reads bits 4 or 8 in checkpoint_format gptq or gptq_v2")
        return QuantFormat(method, bits, group, v1_zeros=fmt == "gptq")
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm" or bits != 4:
        raise ValueError(f"{source}: AWQ version {version!r} with bits={bits} is not read by tokenmill; it reads "
                         "quantization_config.version 'gemm' with 4 bits")
    return QuantFormat(method, bits, group)


def refuse_unmarked_quantized(keys: Iterable[str], source: str) -> None:
    """Raise ValueError when a folder without quantization_config holds GPTQ-style tensors (qweight, qzeros,
    g_idx): its config.json lost the quantization_config its producer wrote."""
    found = next((k for k in keys if k.endswith(_GPTQ_MARKERS)), None)
    if found is not None:
        raise ValueError(f"{source} holds GPTQ-style tensors ({found}, ...) but its config.json has no "
                         "quantization_config; restore the config.json its quantizer wrote (with quant_method)")


def quantized_modules(keys: Iterable[str], fmt: QuantFormat) -> dict[str, list[str]]:
    """{checkpoint module name: its quantization tensor keys} of a quantized folder, from the tensor names."""
    parts = _GPTQ_PARTS if fmt.method in ("gptq", "awq") else _CT_PARTS
    out: dict[str, list[str]] = {}
    for key in keys:
        module, _, suffix = key.rpartition(".")
        if suffix in parts:
            out.setdefault(module, []).append(key)
    if fmt.method == "compressed-tensors":  # int-quantized and fp8 layers keep their weight under ".weight"
        out = {m: ks + ([f"{m}.weight"] if f"{m}.weight" in keys else []) for m, ks in out.items()}
    return out


def param_names(keys: Iterable[str], fmt: QuantFormat) -> list[str]:
    """The plain checkpoint keys a quantized folder's model reads: each quantized module as "<module>.weight", its
    other keys as they are (biases, norms, the embedding)."""
    keys = list(keys)
    modules = quantized_modules(keys, fmt)
    taken = {k for ks in modules.values() for k in ks}
    return [k for k in keys if k not in taken] + [f"{m}.weight" for m in modules]


@dataclass
class QuantReport:
    """How a quantized folder's layers were loaded: `int4` (module names kept as stored INT4) and `dequantized`
    (module name -> why: a reason the INT4 kernels cannot hold it exactly, or the mode asked for it)."""

    format: str
    int4: list[str] = field(default_factory=list)
    dequantized: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line, e.g. "gptq 4-bit, group 128: 14 layers INT4 as stored, 2 dequantized exactly (8-bit ...: 2)"."""
        reasons: dict[str, int] = {}
        for why in self.dequantized.values():
            reasons[why] = reasons.get(why, 0) + 1
        detail = "; ".join(f"{why}: {n}" for why, n in sorted(reasons.items()))
        return (f"{self.format}: {len(self.int4)} layers INT4 as stored, {len(self.dequantized)} dequantized exactly"
                + (f" ({detail})" if detail else ""))


def read_layer(get: Callable[[str], torch.Tensor | None], module: str,
               fmt: QuantFormat) -> IntGroupWeight | torch.Tensor:
    """One quantized layer: IntGroupWeight for integer formats, the exact fp32 weight [N, K] for fp8. Raises
    ValueError for a missing tensor, disagreeing shapes, or a layer no config group covers."""
    from engine.loading.compressed_tensors import read_ct_float, read_ct_int
    from engine.loading.gptq_awq import read_awq_gemm, read_gptq

    if fmt.method == "gptq":
        return read_gptq(get, module, fmt.bits, fmt.group_size, fmt.v1_zeros)
    if fmt.method == "awq":
        return read_awq_gemm(get, module, fmt.bits, fmt.group_size)
    scheme = scheme_for(module, fmt.schemes, fmt.ignore)
    if scheme is None:
        raise ValueError(f"{module} holds quantized tensors but no quantization_config.config_groups entry targets "
                         "it (or `ignore` names it)")
    return read_ct_float(get, module, scheme) if scheme.type == "float" else read_ct_int(get, module, scheme)


def iter_quantized_state(files: list[str], fmt: QuantFormat, param_name: Callable[[str], str], dtype: torch.dtype,
                         keep_int4: bool, report: QuantReport,
                         skip: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, Any]]:
    """(name, value) per parameter of a quantized HF folder, one layer at a time: a quantized layer as an
    Int4Weight under its module name (our names, through `param_name`) when `keep_int4` and exact, else its exactly
    dequantized weight in `dtype` under "<module>.weight"; other tensors in `dtype`. Names for which `skip` is true
    (a tied LM head) are left out. Fills `report`. Raises ValueError as read_layer."""
    from safetensors import safe_open

    from engine.loading.quant_groups import IntGroupWeight

    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(f, framework="pt")) for f in files]
        where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 (safe_open is not a dict)

        def get(key: str) -> torch.Tensor | None:
            h = where.get(key)
            return None if h is None else h.get_tensor(key)

        modules = quantized_modules(where, fmt)
        taken = {k for ks in modules.values() for k in ks}
        for key in where:
            if key not in taken and not key.endswith("rotary_emb.inv_freq") and not skip(param_name(key)):
                yield param_name(key), get(key).to(dtype)
        for module in modules:
            name = param_name(module)
            if skip(f"{name}.weight"):
                continue
            layer = read_layer(get, module, fmt)
            plan, why = layer.int4_plan() if isinstance(layer, IntGroupWeight) else (None, "fp8 weights")
            if keep_int4 and plan is not None:
                report.int4.append(name)
                yield name, layer.to_int4(plan)
                continue
            report.dequantized[name] = why if keep_int4 else "quantization 'none' or 'int8' asked for dequantized"
            w = layer.dequantize() if isinstance(layer, IntGroupWeight) else layer
            yield f"{name}.weight", w.to(dtype)

