"""GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K weights kept as their own blocks, and the exact small-M GEMM that reads them.

ggml block layouts (ggml-common.h `block_q4_0`, `block_q4_1`, `block_q8_0`; 32 weights per block, blocks run along a
row; gguf-py quants.py `dequantize_blocks` computes each in float32):
    Q4_0: fp16 d, 16 bytes qs              w = d * (q - 8),  q in 0..15
    Q4_1: fp16 d, fp16 m, 16 bytes qs      w = d * q + m,    q in 0..15
    Q8_0: fp16 d, 32 int8 qs               w = d * q,        q in -128..127
Byte j of a Q4 block's qs holds element j in its low nibble and element j + 16 in its high nibble.
    Q4_K (`block_q4_K`, the "K-quant" of most Q4_K_M files): 256-weight super-blocks of fp16 d and dmin, 12 bytes of
    6-bit scales sc and mins m (one pair per 32 weights, gguf-py `Q4_K.get_scale_min`), 128 bytes of nibbles;
    w = (d * sc) * q - dmin * m, q in 0..15 (32 bytes hold two 32-weight sub-blocks: low nibbles the first, high
    the second).

`GGUFBlocks` keeps qs as they are and d (and m) widened to fp32, which is exact. Every weight is then
w = fma(scale, q, min) with min = m (Q4_1), -8 d (Q4_0, exact: a power of two times d), none (Q8_0: w = scale * q).
Since d has 11 significant bits and q at most 8, d * q is exact in fp32, so fma(d, q, m) rounds once, as gguf's
`d * q + m` does: the weights equal `gguf.quants.dequantize` bit for bit for Q4_1 and Q8_0, and for Q4_0 as numbers
(d * (q - 8) and fma(d, q, -8 d) are both exact; they differ only in the sign of a zero weight when d < 0: -0 there,
+0 here, which no product or sum can tell apart except an all-zero sum's sign). A Q4_K super-block becomes eight
Q4_1-shaped blocks, nibbles regrouped into that order, scale = d * sc and min = -(dmin * m): both products are exact
in fp32 (11 significant bits times 6), so fma(scale, q, min) rounds once, as gguf's `d * q - dm` does: bit for bit.

`gguf_linear(x, blocks)` = x @ W^T in fp32 reading 0.75 (Q4_0, Q4_1: fp32 scale and min beside 16 bytes of nibbles
per block; GGUF's fp16 ones make 0.5625 / 0.625) or 1.125 (Q8_0) bytes per weight instead of fp32's 4: the C++
op `gguf_linear` of engine/kernels/csrc/cpu_kernels.cpp where it built, else the same function in torch
(`x @ blocks.dequantize().T`). Only the fp32 summation order differs between the two, as between oneDNN kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.kernels import cpu_kernels

BLOCK_SIZE = 32  # weights per GGUF block, for all three types
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}  # Q4_K: per 256-weight super-block
SUPER_BLOCK = 256  # weights per Q4_K super-block (ggml QK_K)
SUPPORTED_TYPES = tuple(_BLOCK_BYTES)
# The `.gguf_type` code stored with the blocks, and the C++ op's type_code: ggml's own type ids (ggml.h ggml_type).
TYPE_CODES = {name: int(GGMLQuantizationType[name]) for name in SUPPORTED_TYPES}
_TYPE_NAMES = {code: name for name, code in TYPE_CODES.items()}
_NO_MINS = torch.empty(0)  # the op's mins for Q8_0


def _check_type(type_name: str) -> None:
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name!r} has no block kernel; supported: {', '.join(SUPPORTED_TYPES)} "
                         "(load other types dequantized)")


@dataclass
class GGUFBlocks:
    """One weight W [N, K] (torch order: N = out_features) as its GGUF blocks.

    Attributes:
        type_name: "Q4_0", "Q4_1", "Q8_0" or "Q4_K" (held as Q4_1-shaped blocks: module docstring).
        qs: Q4: uint8 [N, K / 32, 16] (GGUF's byte order: element j < 16 is qs[j] & 0xF, j + 16 is qs[j] >> 4);
            Q8_0: int8 [N, K / 32, 32].
        scales: fp32 [N, K / 32], the blocks' fp16 d widened (exact).
        mins: fp32 [N, K / 32]: Q4_1's fp16 m, Q4_0's -8 d (both exact); None for Q8_0.
    Weight element (n, 32 b + j) = fma(scales[n, b], q, mins[n, b]) (scales[n, b] * q for Q8_0).
    Raises ValueError (at construction) for an unknown type or parts whose dtypes or shapes do not fit together.
    """

    type_name: str
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __post_init__(self) -> None:
        _check_type(self.type_name)
        q8 = self.type_name == "Q8_0"
        dtype, width = (torch.int8, 32) if q8 else (torch.uint8, 16)
        if self.qs.dim() != 3 or self.qs.dtype != dtype or self.qs.shape[2] != width:
            raise ValueError(f"{self.type_name} qs must be {dtype} [N, K / 32, {width}], got {self.qs.dtype} "
                             f"{tuple(self.qs.shape)}")
        n, nb = self.qs.shape[:2]
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (n, nb):
            raise ValueError(f"scales must be float32 [{n}, {nb}], got {self.scales.dtype} {tuple(self.scales.shape)}")
        if q8 != (self.mins is None):
            raise ValueError(f"{self.type_name} takes {'no mins' if q8 else 'mins'}; got "
                             f"{'none' if self.mins is None else 'mins'}")
        if self.mins is not None and (self.mins.dtype != torch.float32 or tuple(self.mins.shape) != (n, nb)):
            raise ValueError(f"mins must be float32 [{n}, {nb}], got {self.mins.dtype} {tuple(self.mins.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): out_features, in_features."""
        return self.qs.shape[0], self.qs.shape[1] * BLOCK_SIZE

    @property
    def type_code(self) -> int:
        """ggml's id of the type (Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12): what `to_state` stores."""
        return TYPE_CODES[self.type_name]

    @property
    def kernel_code(self) -> int:
        """The C++ op's type_code: the layout the blocks have in memory (Q4_K is held as Q4_1-shaped blocks)."""
        return TYPE_CODES["Q4_1"] if self.type_name == "Q4_K" else TYPE_CODES[self.type_name]

    @property
    def nbytes(self) -> int:
        """Bytes the blocks take in memory (qs, scales, mins): what one GEMM reads."""
        parts = [self.qs, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in parts)

    @classmethod
    def from_raw(cls, raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GGUFBlocks:
        """The blocks of a GGUF tensor from its raw bytes, with no rounding.

        raw: the GGUFReader tensor's `data` (uint8, any shape holding N * K / 32 blocks); type_name: its
        `tensor_type.name`; shape: (N, K) in torch order (ggml lists K first). Raises ValueError for a type other
        than Q4_0 / Q4_1 / Q8_0 / Q4_K, K not a multiple of 32 (256 for Q4_K), or a byte count that does not match
        the shape.
        """
        _check_type(type_name)
        n, k = shape
        if type_name == "Q4_K":
            return cls._from_q4_k(raw, n, k)
        if k % BLOCK_SIZE:
            raise ValueError(f"a {type_name} tensor's rows must be whole 32-weight blocks, got K={k}; load it "
                             "dequantized instead")
        nb, nbytes = k // BLOCK_SIZE, _BLOCK_BYTES[type_name]
        flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        if flat.size != n * nb * nbytes:
            raise ValueError(f"{type_name} [{n}, {k}] takes {n * nb * nbytes} bytes, the tensor has {flat.size}")
        blocks = flat.reshape(n, nb, nbytes)
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if type_name == "Q8_0":
            return cls(type_name, torch.from_numpy(blocks[..., 2:].copy().view(np.int8)), torch.from_numpy(scales),
                       None)
        if type_name == "Q4_1":
            mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            mins = scales * np.float32(-8)
        qs = np.ascontiguousarray(blocks[..., nbytes - 16:])
        return cls(type_name, torch.from_numpy(qs), torch.from_numpy(scales), torch.from_numpy(mins))

    @classmethod
    def _from_q4_k(cls, raw: np.ndarray, n: int, k: int) -> GGUFBlocks:
        """Q4_K super-blocks as Q4_1-shaped blocks (module docstring), exactly."""
        from gguf.quants import Q4_K

        if k % SUPER_BLOCK:
            raise ValueError(f"a Q4_K tensor's rows must be whole 256-weight super-blocks, got K={k}; load it "
                             "dequantized instead")
        nsb = n * (k // SUPER_BLOCK)
        flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        if flat.size != nsb * _BLOCK_BYTES["Q4_K"]:
            raise ValueError(f"Q4_K [{n}, {k}] takes {nsb * _BLOCK_BYTES['Q4_K']} bytes, the tensor has {flat.size}")
        sb = flat.reshape(nsb, _BLOCK_BYTES["Q4_K"])
        d = sb[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nsb, 1]
        dmin = sb[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(sb[:, 4:16])  # [nsb, 8] each, 0..63
        scales = d * sc.astype(np.float32)
        mins = -(dmin * m.astype(np.float32))
        qs = sb[:, 16:].reshape(nsb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(nsb, 8, 32)  # sub-block j's 32 values, in element order
        packed = q[..., :16] | (q[..., 16:] << np.uint8(4))  # this class's byte order
        nb = k // BLOCK_SIZE
        return cls("Q4_K", torch.from_numpy(np.ascontiguousarray(packed.reshape(n, nb, 16))),
                   torch.from_numpy(np.ascontiguousarray(scales.reshape(n, nb))),
                   torch.from_numpy(np.ascontiguousarray(mins.reshape(n, nb))))

    def quants(self) -> torch.Tensor:
        """The integer values q as float32 [N, K / 32, 32] in element order (0..15 for Q4, -128..127 for Q8_0)."""
        if self.type_name == "Q8_0":
            return self.qs.float()
        return torch.cat((self.qs & 0xF, self.qs >> 4), dim=-1).float()

    def dequantize(self) -> torch.Tensor:
        """W as fp32 [N, K]: scale * q + min per element (exact product, one rounding: the fma the kernel does)."""
        w = self.quants() * self.scales[..., None]
        if self.mins is not None:
            w += self.mins[..., None]
        return w.reshape(self.shape)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GGUFBlocks:
        """The same row permutation `fn(tensor) -> tensor` (e.g. engine.loading.gguf_file.unpermute_rope_rows, which
        takes
        any trailing shape) applied to qs, scales and mins."""
        return GGUFBlocks(self.type_name, fn(self.qs).contiguous(), fn(self.scales).contiguous(),
                          None if self.mins is None else fn(self.mins).contiguous())

    @staticmethod
    def concat(parts: Sequence[GGUFBlocks]) -> GGUFBlocks | None:
        """The parts stacked along N (fused QKV, gate_up), or None when they differ in type or K (the caller then
        keeps them apart or dequantizes) or there are none."""
        if not parts or any(p.type_name != parts[0].type_name or p.shape[1] != parts[0].shape[1] for p in parts):
            return None
        return GGUFBlocks(parts[0].type_name, torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]),
                          None if parts[0].mins is None else torch.cat([p.mins for p in parts]))  # type: ignore[misc]

    def to_state(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors to save (e.g. in a safetensors weights cache): `{prefix}.gguf_qs`, `.gguf_scales`, `.gguf_mins`
        (not for Q8_0) and `.gguf_type`, uint8 [1] holding `type_code`."""
        state = {f"{prefix}.gguf_qs": self.qs, f"{prefix}.gguf_scales": self.scales,
                 f"{prefix}.gguf_type": torch.tensor([self.type_code], dtype=torch.uint8)}
        if self.mins is not None:
            state[f"{prefix}.gguf_mins"] = self.mins
        return state

    @classmethod
    def from_state(cls, prefix: str, state: dict[str, torch.Tensor]) -> GGUFBlocks:
        """Inverse of `to_state`. Raises ValueError when `{prefix}.gguf_type` or another part is missing, the code
        is unknown, or the parts do not fit together."""
        code_t = state.get(f"{prefix}.gguf_type")
        if code_t is None or code_t.numel() != 1:
            raise ValueError(f"{prefix}.gguf_type is missing from the state; it was not saved by GGUFBlocks.to_state")
        code = int(code_t.item())
        if code not in _TYPE_NAMES:
            raise ValueError(f"{prefix}.gguf_type holds {code}, not a GGUF block type this engine reads "
                             f"({TYPE_CODES}); rebuild the weights cache")
        try:
            return cls(_TYPE_NAMES[code], state[f"{prefix}.gguf_qs"], state[f"{prefix}.gguf_scales"],
                       state.get(f"{prefix}.gguf_mins"))
        except KeyError as e:
            raise ValueError(f"{e.args[0]} is missing from the state; rebuild the weights cache") from None


def gguf_linear(x: torch.Tensor, blocks: GGUFBlocks) -> torch.Tensor:
    """y = x W^T for fp32 x [M, K] and W = blocks [N, K]: fp32 [M, N] (no bias).

    The C++ op reads the blocks, dequantizes each once into registers and uses it for every row of x (fast for small
    M: bandwidth); without the compiled kernels, or for an x that requires grad, `x @ blocks.dequantize().T`, the
    same function (fp32 sums in another order). Raises ValueError for x that is not fp32 [M, K] on the CPU.
    """
    n, k = blocks.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"gguf_linear takes fp32 CPU x [M, {k}], got {x.dtype} {tuple(x.shape)} on {x.device}; "
                         "flatten the leading dims and convert first")
    ops = cpu_kernels.cpu_ops()  # looked up per call, so TOKENMILL_CPU_KERNELS tests can patch it
    if ops is None or x.requires_grad:  # the op has no backward: autograd through x takes the torch form
        return x @ blocks.dequantize().T
    return ops.gguf_linear(x.contiguous(), blocks.qs, blocks.scales,
                           _NO_MINS if blocks.mins is None else blocks.mins, blocks.kernel_code)


#: The state-dict suffix of the GGUF block entries (engine.kernels.gguf_blocks.GGUFBlocks.to_state:
#: `{module}.gguf_qs`...).
GGUF_KEY_PREFIX = "gguf_"


def is_block_key(name: str) -> bool:
    """True for a state-dict entry that holds a GGUF block tensor (GGUFBlocks.to_state), not a parameter."""
    return name.rsplit(".", 1)[-1].startswith(GGUF_KEY_PREFIX)
