"""Hugging Face folders whose config.json has a `quantization_config`: which methods tokenmill reads, the refusals
of everything else, and the state dict of such a folder, its layers kept as stored INT4 or dequantized exactly.

Methods read (engine.loading.gptq_awq, engine.loading.compressed_tensors; the arithmetic: engine.loading.quant_groups):
    gptq                4 or 8 bits, any group size (-1 = per channel), sym or asym, desc_act (g_idx), checkpoint
                        format v1 (zeros stored minus 1, the default) or gptq_v2
    awq                 version gemm, 4 bits, zero points
    compressed-tensors  pack-quantized int4/int8 (group or channel, sym or asym), int-quantized int8, float-quantized
                        fp8 (tensor, channel or block scales)
A layer goes to the INT4 kernels with its integers and scales as stored when that is exact
(IntGroupWeight.int4_plan; act-order layers with their input features permuted once at load), a W8A8 layer to the
CPU's INT8 kernel (IntGroupWeight.to_int8), else it is dequantized exactly; `QuantReport` says which layers took
which way and why. A mixture-of-experts folder's per-expert layers (model.layers.0.mlp.experts.3.gate_proj.qweight ...)
go the same ways one by one and are then stacked per projection (stack_experts): INT4 as stored when every expert of
the projection is, else dequantized exactly; its router and shared expert are read as the checkpoint stores them.
Modes that would quantize such a folder a second time are refused (check_quantization_mode).
Imports nothing of engine.loading.hf_folder (which imports this module), and torch only where tensors are read: the
CLI's preflight checks a folder's config and tensor names through it.
"""

from __future__ import annotations

import contextlib
import re
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

    def is_w8a8(self) -> bool:
        """True for a compressed-tensors folder whose every quantized group is W8A8 with dynamic per-token
        activations (CTScheme.w8a8_dynamic): what quantization 'int8' runs, so its integers are kept, not redone."""
        return self.method == "compressed-tensors" and bool(self.schemes) and all(
            s.w8a8_dynamic() for s in self.schemes)

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
    if method == "mxfp4" and config.get("model_type") == "gpt_oss":
        return None  # gpt-oss's MXFP4 experts, dequantized exactly as read (engine.loading.gpt_oss_tensors)
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


def check_quantization_mode(fmt: QuantFormat, quantization: str, source: str) -> None:
    """Raise ValueError (one line naming quant_method and the modes to use) when the engine's `quantization` would
    quantize an already quantized folder a second time: "int4" always, "int8" unless the folder is W8A8
    (QuantFormat.is_w8a8; its stored INT8 integers are then kept). "auto" and "none" always pass."""
    if quantization == "int4" or (quantization == "int8" and not fmt.is_w8a8()):
        raise ValueError(f"{source} is already quantized (quantization_config.quant_method {fmt.method!r}, "
                         f"{fmt.describe()}); quantization '{quantization}' would quantize it a second time: use "
                         "'auto' (its stored integers kept where the kernels hold them exactly) or 'none' "
                         "(dequantized exactly)")


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
    """How a quantized folder's layers were loaded: `int4` (module names kept as stored INT4; `permuted`: those of
    them whose input features were reordered, act-order), `int8` (kept as stored INT8, W8A8) and `dequantized`
    (module name -> why: a reason the kernels cannot hold it exactly, or the mode asked for it)."""

    format: str
    int4: list[str] = field(default_factory=list)
    permuted: list[str] = field(default_factory=list)
    int8: list[str] = field(default_factory=list)
    dequantized: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line, e.g. "gptq 4-bit, group 128: 14 layers INT4 as stored (14 act-order, input permuted at load),
        2 dequantized exactly (8-bit ...: 2)"; a mixture-of-experts folder's experts count one layer per expert and
        projection ("... 56 layers INT4 as stored (48 of them experts' projections) ...")."""
        reasons: dict[str, int] = {}
        for why in self.dequantized.values():
            reasons[why] = reasons.get(why, 0) + 1
        detail = "; ".join(f"{why}: {n}" for why, n in sorted(reasons.items()))
        notes = [f"{n} {what}" for n, what in ((sum(".experts." in name for name in self.int4),
                                                 "of them experts' projections"),
                                                (len(self.permuted), "act-order, input permuted at load")) if n]
        parts = [f"{len(self.int4)} layers INT4 as stored" + (f" ({'; '.join(notes)})" if notes else "")]
        if self.int8:
            parts = [f"{len(self.int8)} layers INT8 as stored (W8A8)"] + (parts if self.int4 else [])
        parts.append(f"{len(self.dequantized)} dequantized exactly" + (f" ({detail})" if detail else ""))
        return f"{self.format}: " + ", ".join(parts)


@dataclass
class KeepStored:
    """Which stored integers a load keeps: `int4` (4-bit layers to the INT4 kernels where exact; `act_order`: also
    act-order ones, their input permuted), `int8_qmax` (W8A8 layers to the CPU INT8 kernel when it sums their |q|
    exactly: engine.quant.int8_linear.int8_weight_qmax; None = no INT8 kernel here, `int8_off` says why)."""

    int4: bool = True
    act_order: bool = True
    int8_qmax: float | None = None
    int8_off: str = "no INT8 kernel on this device (the W8A8 kernel is the CPU's oneDNN int8 GEMM)"


#: The reason of every dequantized layer when the mode asks for plain weights.
DEQUANTIZE_ALL = "quantization 'none' asked for dequantized"


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


def keep_layer(layer: IntGroupWeight | torch.Tensor, scheme: CTScheme | None,
               keep: KeepStored | None) -> tuple[Any, str]:
    """(Int4Weight or Int8Weight of the stored integers, "") when `keep` holds this layer as stored, else (None, why
    it is dequantized). keep None: the mode asked for dequantized weights."""
    from engine.loading.quant_groups import IntGroupWeight

    if keep is None:
        return None, DEQUANTIZE_ALL
    if not isinstance(layer, IntGroupWeight):
        return None, "fp8 weights"
    if scheme is not None and scheme.activations:
        if scheme.w8a8_dynamic():
            return layer.to_int8(keep.int8_qmax) if keep.int8_qmax is not None else (None, keep.int8_off)
        if layer.bits == 8:
            return None, "int8 activations not dynamic per token (the INT8 kernel's scheme)"
    if not keep.int4:
        return None, "quantization keeps no INT4 here"
    group, perm, why = layer.int4_plan(keep.act_order)
    return (None, why) if group is None else (layer.to_int4(group, perm), "")


def iter_quantized_state(files: list[str], fmt: QuantFormat, param_name: Callable[[str], str], dtype: torch.dtype,
                         keep: KeepStored | None, report: QuantReport,
                         skip: Callable[[str], bool] = lambda name: False) -> Iterator[tuple[str, Any]]:
    """(name, value) per parameter of a quantized HF folder, one layer at a time: a quantized layer that `keep`
    holds as stored (keep_layer) as an Int4Weight or Int8Weight under its module name (our names, through
    `param_name`), else its exactly dequantized weight in `dtype` under "<module>.weight"; other tensors in `dtype`.
    keep None: every layer dequantized. Names for which `skip` is true (a tied LM head) are left out. Fills `report`.
    Raises ValueError as read_layer."""
    from safetensors import safe_open

    from engine.loading.quant_groups import IntGroupWeight
    from engine.quant.qparams import Int8Weight

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
            scheme = scheme_for(module, fmt.schemes, fmt.ignore) if fmt.method == "compressed-tensors" else None
            kept, why = keep_layer(layer, scheme, keep)
            if kept is not None:
                (report.int8 if isinstance(kept, Int8Weight) else report.int4).append(name)
                if getattr(kept, "in_perm", None) is not None:
                    report.permuted.append(name)
                yield name, kept
                continue
            report.dequantized[name] = why
            w = layer.dequantize() if isinstance(layer, IntGroupWeight) else layer
            yield f"{name}.weight", w.to(dtype)


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def stack_experts(items: Iterator[tuple[str, Any]], num_experts: int, dtype: torch.dtype,
                  report: QuantReport) -> Iterator[tuple[str, Any]]:
    """`items` (iter_quantized_state's, our names) with a mixture-of-experts layer's per-expert entries
    ("layers.0.mlp.experts.3.gate_proj", an Int4Weight, or "...experts.3.gate_proj.weight", a tensor) stacked once all
    `num_experts` of a projection have come: one StackedInt4 [E, N, Kp/2] under "layers.0.mlp.experts.gate_proj" when
    every expert was kept INT4 alike (engine.quant.experts serves it), else every expert dequantized exactly into
    one [E, N, K] tensor in `dtype` under "...gate_proj.weight" (`report` then lists them as dequantized, with why:
    INT8 experts have no W8A8 expert kernel). Other entries pass through. Raises ValueError when a projection lacks
    experts at the end."""
    import torch

    from engine.quant.qparams import Int4Weight
    from engine.quant.stacked_int4 import StackedInt4

    pending: dict[str, dict[int, Any]] = {}
    for name, value in items:
        m = _EXPERT_INDEX.search(name)
        if m is None:
            yield name, value
            continue
        stacked = f"{name[:m.start()]}.experts.{name[m.end():]}"
        param = stacked if isinstance(value, torch.Tensor) else f"{stacked}.weight"
        group = pending.setdefault(param, {})
        group[int(m.group(1))] = value
        if len(group) < num_experts:
            continue
        parts = [group[e] for e in range(num_experts)]
        del pending[param]
        if all(isinstance(p, Int4Weight) for p in parts):
            try:
                yield param.removesuffix(".weight"), StackedInt4.from_weights(parts)
                continue
            except ValueError:  # shapes, group sizes or scale dtypes that differ between experts
                why = "experts of one projection stored in different INT4 forms"
        else:
            kinds = {type(p).__name__ for p in parts if not isinstance(p, torch.Tensor)}
            why = ("INT8 experts (no W8A8 expert kernel)" if "Int8Weight" in kinds else
                   "experts of one projection stored in different forms")
        for e, p in enumerate(parts):
            if not isinstance(p, torch.Tensor):
                module = stacked.removesuffix(".weight").replace(".experts.", f".experts.{e}.", 1)
                for kept in (report.int4, report.int8, report.permuted):
                    if module in kept:
                        kept.remove(module)
                report.dequantized[module] = why
        yield param, torch.stack([p.to(dtype) if isinstance(p, torch.Tensor) else p.dequantize(dtype) for p in parts])
    if pending:
        raise ValueError(f"{next(iter(pending))} lacks experts: the checkpoint holds fewer than {num_experts}")
