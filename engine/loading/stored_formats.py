"""The stored formats tokenmill reads and the held form each becomes: STORED_FORMATS, one table.

A stored format is how a file keeps a weight (safetensors floats, a GGUF type, GPTQ / AWQ / compressed-tensors
integers, MXFP4, a tokenmill INT4 folder); a held form is how the weight sits in memory for its device's kernel
(engine.quant.forms.HELD_FORMS, by name here, so this module needs no torch: the client's checks may read it).
Each row says the held form under `--quantization auto` (`held`), and the one it falls back to (`otherwise`):
under "none", on a device without that form's kernel, or where the stored numbers do not map onto the form
exactly (then they are dequantized exactly, and the load report says so). "int4" and "int8" quantize what stays
dense on load (engine.loading.quantized's modes).
"""

from __future__ import annotations

from typing import NamedTuple


class StoredFormat(NamedTuple):
    """One stored format: the held form it becomes under "auto", the one otherwise, and the module that reads it.

    Attributes:
        held: a HELD_FORMS name (engine.quant.forms).
        otherwise: a HELD_FORMS name: under "none", off the held form's devices, or where it is not exact
            ("gguf_blocks": in fp32 on the CPU; the weight is dense elsewhere).
        reader: the dotted module that reads the format.
    """

    held: str
    otherwise: str
    reader: str


#: stored format -> the held form it becomes (engine.quant.forms.HELD_FORMS names).
STORED_FORMATS: dict[str, StoredFormat] = {
    # plain floats
    "safetensors F32 / F16 / BF16": StoredFormat("dense", "dense", "engine.loading.hf_folder"),
    "gguf F32 / F16 / BF16": StoredFormat("dense", "dense", "engine.loading.gguf_file"),
    # GGUF block types: the 4-bit ones map onto INT4 exactly (group 32); under "none" in fp32 on the CPU the block
    # types with a kernel keep their blocks beside the fp32 copy (engine.kernels.gguf_blocks)
    "gguf Q4_0 / Q4_1 / Q4_K": StoredFormat("int4", "gguf_blocks", "engine.loading.gguf_int4"),
    "gguf Q8_0": StoredFormat("dense", "gguf_blocks", "engine.loading.gguf_file"),
    "gguf other types (Q5_K, Q6_K, ...)": StoredFormat("dense", "dense", "engine.loading.gguf_file"),
    "gguf Q4_0 / Q4_1 / Q4_K experts (ffn_*_exps)": StoredFormat("stacked_int4", "dense", "engine.loading.gguf_int4"),
    "gguf MXFP4 experts (gpt-oss)": StoredFormat("dense", "dense", "engine.loading.gpt_oss_tensors"),
    "safetensors MXFP4 experts (gpt-oss)": StoredFormat("dense", "dense", "engine.loading.gpt_oss_tensors"),
    # quantized Hugging Face folders (engine.loading.hf_quantized: each layer INT4 as stored where exact)
    "gptq 4-bit": StoredFormat("int4", "dense", "engine.loading.gptq_awq"),
    "gptq 8-bit": StoredFormat("dense", "dense", "engine.loading.gptq_awq"),
    "awq 4-bit (gemm)": StoredFormat("int4", "dense", "engine.loading.gptq_awq"),
    "compressed-tensors pack-quantized 4-bit": StoredFormat("int4", "dense", "engine.loading.compressed_tensors"),
    "compressed-tensors int-quantized W8A8": StoredFormat("int8_w8a8", "dense", "engine.loading.compressed_tensors"),
    "compressed-tensors float-quantized fp8": StoredFormat("dense", "dense", "engine.loading.compressed_tensors"),
    "gptq / awq / compressed-tensors 4-bit experts": StoredFormat("stacked_int4", "dense",
                                                                  "engine.loading.hf_quantized"),
    # tokenmill folders (`tokenmill quantize`)
    "tokenmill INT4": StoredFormat("int4", "dense", "engine.loading.tokenmill_folder"),
    "tokenmill INT4 experts": StoredFormat("stacked_int4", "dense", "engine.loading.tokenmill_folder"),
    "tokenmill bf16": StoredFormat("dense", "dense", "engine.loading.tokenmill_folder"),
}
