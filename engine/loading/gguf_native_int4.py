"""Which tensors of a GGUF file the engine holds as INT4 just as the file stores them (a GGUF model under
--quantization auto: engine.loading.gguf_int4 maps their blocks, no requantizing), asked without torch: the loader
(engine.loading.gguf_file) and the client's fit check (jobs.plan.model_fit, which counts their bytes before a job in
a process that never imports torch) both decide here.
"""

from __future__ import annotations

from engine.model.tensor_names import is_expert_weight, is_linear_weight

#: The group size of every native type's scales: Q4_0 and Q4_1 blocks are 32 weights, Q4_K super-blocks of 256 hold
#: eight groups of 32.
GGUF_GROUP_SIZE = 32
#: The ggml types whose 4-bit weights map onto the INT4 format exactly (engine.loading.gguf_int4).
NATIVE_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def is_native_int4(tensor_type_name: str) -> bool:
    """True for the GGUF types that load as INT4 without requantizing (NATIVE_INT4_TYPES; gguf's
    GGMLQuantizationType names)."""
    return tensor_type_name in NATIVE_INT4_TYPES


def loads_as_native_int4(name: str, tensor_type_name: str) -> bool:
    """True for a GGUF tensor held as INT4 as stored: `name` (our parameter name, engine.loading.gguf_config's
    gguf_name_map) a linear or stacked expert projection weight (engine.model.tensor_names) and its type one of
    NATIVE_INT4_TYPES."""
    return (is_linear_weight(name) or is_expert_weight(name)) and is_native_int4(tensor_type_name)


def gguf_weight_types(path: str) -> tuple[list[tuple[str, int, str]], int]:
    """(our parameter name, element count, ggml type name) of every weight of the GGUF file at `path` but the RoPE
    factors, named as the engine loads them (engine.loading.gguf_config.gguf_name_map, from the header alone:
    engine.loading.gguf_header.GGUFHeader, no torch), and its vocabulary size; ([], 0) for a header the scan does not
    follow (the engine checks that file when it loads it). Raises OSError for a file that cannot be read, ValueError
    for one that is not GGUF v2/v3."""
    from engine.loading.gguf_config import gguf_name_map, read_gguf_config
    from engine.loading.gguf_header import GGUFHeader, Unfollowed

    try:
        header = GGUFHeader(path)
    except Unfollowed:
        return [], 0
    cfg = read_gguf_config(header)
    ours = gguf_name_map(header, cfg)
    return [(ours[t.name], t.n_elements, t.tensor_type.name) for t in header.tensors if t.name in ours], cfg.vocab_size


#: ggml types that hold weights unquantized (a "none" load converts them to the compute dtype, nothing to report).
_PLAIN_TYPES = ("F32", "F16", "BF16", "F64")


def gguf_dequantized_note(path: str, dtype_name: str) -> str | None:
    """What `--quantization none` (the default) does to a quantized GGUF file's weights, for the run's summary, the
    dry run and the accounting (pipeline.accounting.quantization_label): e.g. "gguf: 211 weights Q4_1, 1 Q6_K
    dequantized to bfloat16; --quantization auto keeps the 210 4-bit projections INT4 as stored". None for a file
    with no quantized weight or a header the scan does not follow. Raises as gguf_weight_types."""
    weights, _ = gguf_weight_types(path)
    counts: dict[str, int] = {}
    for _, _, type_name in weights:
        if type_name not in _PLAIN_TYPES:
            counts[type_name] = counts.get(type_name, 0) + 1
    if not counts:
        return None
    kinds = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    listed = ", ".join(f"{n} {t}" if i else f"{n} weights {t}" for i, (t, n) in enumerate(kinds))
    native = sum(loads_as_native_int4(name, type_name) for name, _, type_name in weights)
    kept = (f"; --quantization auto keeps the {native} 4-bit projections INT4 as stored" if native else "")
    return f"gguf: {listed} dequantized to {dtype_name}{kept}"
