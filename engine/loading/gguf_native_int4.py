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
