"""gpt-oss checkpoints' expert tensors under our parameter names, dense or MXFP4 (dequantized exactly).

HF transformers' GptOssExperts (modeling_gpt_oss) stores each layer's experts stacked and transposed:
`mlp.experts.gate_up_proj` [E, hidden, 2I] with gate and up interleaved along its last dimension (gate = columns 0,
2, 4, ..., up = 1, 3, 5, ...), `gate_up_proj_bias` [E, 2I] alike, `down_proj` [E, I, hidden], `down_proj_bias`
[E, hidden]. Our experts (engine.layers.moe.GroupedExperts) hold gate_proj / up_proj weights [E, I, hidden], biases
[E, I], down_proj [E, hidden, I] and [E, hidden]: a weight is transposed and the interleaved rows taken apart.

OpenAI's released checkpoints (quantization_config.quant_method "mxfp4") store the two expert weights as MXFP4 (OCP
"Microscaling Formats (MX) Specification" v1.0, 2023): `<proj>_blocks` uint8 [E, out, in / 32, 16], each byte two
FP4 E2M1 values (low nibble first), and `<proj>_scales` uint8 [E, out, in / 32], one E8M0 power of two (bias 127)
per 32 values. Those are already [E, out, in], our layout; transformers dequantizes them the same way
(integrations/mxfp4.py, convert_moe_packed_tensors) before transposing to its own. Every value is a small dyadic
number times a power of two: exact in fp32 and bf16.

llama.cpp's GGUF files hold the same values as ggml's MXFP4 type (`gguf.GGMLQuantizationType.MXFP4`, written by
convert_hf_to_gguf.py's GptOssModel from those blocks and scales, gate and up rows taken apart): 17 bytes per 32
values, the E8M0 scale byte first, then 16 bytes whose low nibbles hold values 0..15 and high nibbles values 16..31;
ggml multiplies twice the FP4 value by half the scale (`dequantize_gguf_mxfp4`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and numpy only where tensors are read: the CLI's preflight imports hf_folder, and the
    import numpy as np  # client never loads torch (tests/jobs/test_cli_imports.py)
    import torch

#: The 16 FP4 E2M1 values by code (sign bit 3, then 2 exponent bits and 1 mantissa bit): OCP MX v1.0, section 5.3.3.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per E8M0 scale
_E8M0_BIAS = 127

#: ggml's MXFP4 values by code: twice FP4_E2M1, as integers (so code 8, FP4's -0, is +0 there; ggml-common.h
#: kvalues_mxfp4, gguf-py's MXFP4.kvalues).
GGUF_MXFP4_KVALUES = tuple(int(2 * v) for v in FP4_E2M1)
GGUF_MXFP4_BLOCK_BYTES = 1 + MXFP4_BLOCK // 2

#: Checkpoint suffixes of a layer's stacked experts -> (our projection, interleaved part or None, kind).
_PROJECTIONS = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1)), "down_proj": (("down_proj", None),)}


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """MXFP4 values as `dtype` (default fp32; exact for fp32 and bf16).

    Args:
        blocks: uint8 [..., G, 16]: 32 FP4 E2M1 codes per group, two per byte, the low nibble the earlier value.
        scales: uint8 [..., G]: each group's E8M0 exponent (2 ** (scale - 127)).
    Returns:
        [..., G * 32] in `dtype`.
    Raises:
        ValueError when the dtypes or shapes do not fit.
    """
    import torch

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] do not match: {tuple(blocks.shape)} and "
                         f"{tuple(scales.shape)}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    values = torch.ldexp(lut[codes.long()], scales.to(torch.int32)[..., None] - _E8M0_BIAS)
    return values.reshape(*blocks.shape[:-2], -1).to(torch.float32 if dtype is None else dtype)


def dequantize_gguf_mxfp4(data: np.ndarray) -> np.ndarray:
    """ggml MXFP4 blocks (a GGUF tensor's data, uint8 [..., G * 17]) as float32 [..., G * 32], bit for bit what
    gguf-py's `gguf.quants.dequantize(data, GGMLQuantizationType.MXFP4)` returns (half the E8M0 scale, built from
    its bits as ggml's ggml_e8m0_to_fp32_half does, times the doubled FP4 value: one fp32 product, so the same
    bits, +0 for code 8 and, for scale byte 255 (E8M0's NaN), 2 ** 127 times the doubled value: inf from 2 up),
    faster (bench/README.md "Figures once quoted in engine/'s docstrings").

    Raises ValueError when the dtype or the last dimension does not fit. Source: ggml-quants.c
    dequantize_row_mxfp4; OCP MX v1.0 (E8M0, FP4 E2M1)."""
    import numpy as np

    if data.dtype != np.uint8 or data.ndim < 1 or data.shape[-1] % GGUF_MXFP4_BLOCK_BYTES:
        raise ValueError(f"MXFP4 data is uint8 [..., G * {GGUF_MXFP4_BLOCK_BYTES}], got {data.dtype} "
                         f"{tuple(data.shape)}")
    blocks = data.reshape(-1, GGUF_MXFP4_BLOCK_BYTES)
    e = blocks[:, :1].astype(np.uint32)
    # NOTE: scale bytes 0 and 1 give fp32 subnormals (2 ** -128, 2 ** -127), the others (e - 1) as the exponent
    half_scale = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).view(np.float32)
    qs = blocks[:, 1:]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=1)  # values 0..15, then 16..31
    with np.errstate(over="ignore"):  # scale byte 255 (E8M0's NaN) gives inf, as in ggml
        values = np.asarray(GGUF_MXFP4_KVALUES, dtype=np.float32)[codes] * half_scale
    return values.reshape(*data.shape[:-1], data.shape[-1] // GGUF_MXFP4_BLOCK_BYTES * MXFP4_BLOCK)


def stacked_expert_index(index: dict[str, tuple[tuple[str, str], ...]], source: str
                         ) -> dict[str, tuple[tuple[str, str], ...]]:
    """`index` ({name: ((file, key), ...)}, names without "model.") with each layer's stacked expert tensors
    ("layers.N.mlp.experts.gate_up_proj", "..._bias", "..._blocks", "..._scales", "...down_proj...") replaced by our
    parameters ("layers.N.mlp.experts.gate_proj.weight", ".bias", ...); an MXFP4 weight's parts are (blocks,
    scales). Raises ValueError naming a blocks tensor without its scales (or the reverse) or a weight stored both
    ways."""
    out: dict[str, tuple[tuple[str, str], ...]] = {}
    for name, parts in index.items():
        prefix, marker, tail = name.rpartition(".experts.")
        stored = tail.removesuffix("_blocks").removesuffix("_scales").removesuffix("_bias")
        if not marker or stored not in _PROJECTIONS:
            out[name] = parts
            continue
        if tail.endswith("_scales"):
            if f"{prefix}.experts.{stored}_blocks" not in index:
                raise ValueError(f"{source} holds {name} without {stored}_blocks")
            continue
        kind = "bias" if tail.endswith("_bias") else "weight"
        if tail.endswith("_blocks"):
            scales = index.get(f"{prefix}.experts.{stored}_scales")
            if scales is None:
                raise ValueError(f"{source} holds {name} without {stored}_scales")
            if f"{prefix}.experts.{stored}" in index:
                raise ValueError(f"{source} holds {prefix}.experts.{stored} both dense and as MXFP4 blocks")
            parts = parts + scales
        for ours, _ in _PROJECTIONS[stored]:
            out[f"{prefix}.experts.{ours}.{kind}"] = parts
    return out


class StackedExpertReader:
    """Reads our expert parameters out of gpt-oss's stacked tensors (module docstring), the last stored tensor kept
    so that gate and up, which share one, are read and dequantized once."""

    def __init__(self, files: dict[str, Any], dtype: torch.dtype) -> None:
        """files: {path: an open safetensors file (safe_open)}; dtype: of the tensors returned."""
        self.files, self.dtype = files, dtype
        self._last: tuple[tuple[tuple[str, str], ...], torch.Tensor] | None = None

    def _stored(self, parts: tuple[tuple[str, str], ...]) -> torch.Tensor:
        """The stored tensor in our [E, out, in] (weight) or [E, out] (bias) layout, gate/up still interleaved."""
        if self._last is not None and self._last[0] == parts:
            return self._last[1]
        (file, key), *rest = parts
        t = self.files[file].get_tensor(key)
        if rest:  # MXFP4 blocks and scales: already [E, out, in]
            t = dequantize_mxfp4(t, self.files[rest[0][0]].get_tensor(rest[0][1]), self.dtype)
        elif t.dim() == 3:  # a dense weight, stored [E, in, out]
            t = t.to(self.dtype).transpose(1, 2)
        else:
            t = t.to(self.dtype)
        self._last = (parts, t)
        return t

    def read(self, name: str, parts: tuple[tuple[str, str], ...]) -> torch.Tensor:
        """Our parameter `name` ("layers.N.mlp.experts.{gate,up,down}_proj.{weight,bias}") from its `parts` as
        `stacked_expert_index` gave them: weight [E, out, in] or bias [E, out], contiguous, in the reader's dtype."""
        t = self._stored(parts)
        projection = name.rsplit(".", 2)[-2]
        half = {"gate_proj": 0, "up_proj": 1}.get(projection)
        return (t if half is None else t[:, half::2]).contiguous()
