"""engine.kernels.gguf_blocks: GGUF Q4_0 / Q4_1 / Q8_0 blocks kept as they are, dequantized bit for bit as gguf-py
does, and
the C++ `gguf_linear` GEMM on them against a float64 x @ W^T of the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

import engine.kernels.cpu_kernels
from engine.kernels.gguf_blocks import SUPPORTED_TYPES, TYPE_CODES, GGUFBlocks, gguf_linear
from engine.loading.gguf_file import unpermute_rope_rows
from engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ops():
    built = engine.kernels.cpu_kernels.cpu_ops()
    if built is None:
        pytest.fail("the CPU kernels did not build (g++ and ninja are test dependencies); see the warning above")
    return built


@pytest.fixture(scope="module")
def reader(gguf_path: str) -> GGUFReader:
    """The default model's GGUF as gguf.GGUFReader reads it: the engine's faster parse of it (a GGUFReader with the same
    fields and tensors, test_weights_cache.py), which tests/engine/conftest.py keeps for the session."""
    from engine.loading import gguf_file

    return gguf_file.open_gguf(gguf_path)


def _tensor(reader: GGUFReader, name: str) -> object:
    return next(t for t in reader.tensors if t.name == name)


def _blocks(t: object, rows: int | None = None) -> tuple[GGUFBlocks, np.ndarray]:
    """GGUFBlocks and gguf's own fp32 dequantization of a GGUF tensor (its first `rows` rows)."""
    raw = t.data if rows is None else t.data[:rows]  # type: ignore[attr-defined]
    n, k = raw.shape[0], int(t.shape[0])  # type: ignore[attr-defined]
    blocks = GGUFBlocks.from_raw(raw, t.tensor_type.name, (n, k))  # type: ignore[attr-defined]
    return blocks, dequantize(raw, t.tensor_type).reshape(n, k)  # type: ignore[attr-defined]


def _bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.int32)


@pytest.fixture(scope="module")
def q4_1(reader: GGUFReader) -> tuple[GGUFBlocks, np.ndarray]:
    return _blocks(_tensor(reader, "blk.0.ffn_down.weight"))  # Q4_1 [576, 1536]


@pytest.fixture(scope="module")
def q8_0(reader: GGUFReader) -> tuple[GGUFBlocks, np.ndarray]:
    return _blocks(_tensor(reader, "token_embd.weight"), rows=1000)  # Q8_0, the tied LM head


@pytest.fixture(scope="module")
def q4_0() -> tuple[GGUFBlocks, np.ndarray]:
    # Synthetic Q4_0 from a real-sized weight (gguf's own quantizer; the default GGUF has no Q4_0 tensor).
    w = np.random.default_rng(0).standard_normal((200, 576)).astype(np.float32) * 0.05
    raw = quantize(w, GGMLQuantizationType.Q4_0)
    return GGUFBlocks.from_raw(raw, "Q4_0", (200, 576)), dequantize(raw, GGMLQuantizationType.Q4_0)


def test_real_q4_1_and_q8_0_dequantize_bit_for_bit(q4_1: tuple, q8_0: tuple) -> None:
    for (blocks, ref), kind in ((q4_1, "Q4_1"), (q8_0, "Q8_0")):
        assert blocks.type_name == kind
        assert blocks.shape == ref.shape
        w = blocks.dequantize()
        assert w.dtype == torch.float32
        np.testing.assert_array_equal(_bits(w), _bits(ref))  # bit for bit, signed zeros included


def test_q4_0_dequantizes_to_gguf_values(q4_0: tuple) -> None:
    blocks, ref = q4_0
    w = blocks.dequantize().numpy()
    # Equal as numbers: gguf's d * (q - 8) is -0 where q = 8 and d < 0, fma(d, q, -8 d) is +0 (module docstring).
    np.testing.assert_array_equal(w, ref)
    nonzero = ref != 0
    np.testing.assert_array_equal(_bits(w[nonzero]), _bits(ref[nonzero]))
    assert torch.equal(blocks.mins, blocks.scales * -8)


def test_bytes_per_weight(q4_1: tuple, q8_0: tuple, q4_0: tuple) -> None:
    # fp32 scales and mins take 8 bytes per block where GGUF's fp16 take 4: 0.75 B/weight for Q4_1 in memory.
    for (blocks, _), per_weight in ((q4_1, 24 / 32), (q8_0, 36 / 32), (q4_0, 24 / 32)):
        n, k = blocks.shape
        assert blocks.nbytes == n * k * per_weight


def test_map_rows_concat_and_state_round_trip(q4_1: tuple, q8_0: tuple, q4_0: tuple) -> None:
    for blocks, _ in (q4_1, q8_0, q4_0):
        w = blocks.dequantize()
        n = blocks.shape[0]
        heads = 8 if n % 16 == 0 else 4
        permuted = blocks.map_rows(lambda t, h=heads: unpermute_rope_rows(t, h))
        assert torch.equal(permuted.dequantize(), unpermute_rope_rows(w, heads))
        both = GGUFBlocks.concat([blocks, permuted])
        assert both is not None and both.shape == (2 * n, blocks.shape[1])
        assert torch.equal(both.dequantize(), torch.cat([w, permuted.dequantize()]))
        state = both.to_state("model.layers.0.mlp.gate_up_proj")
        assert ("model.layers.0.mlp.gate_up_proj.gguf_mins" in state) == (blocks.type_name != "Q8_0")
        back = GGUFBlocks.from_state("model.layers.0.mlp.gate_up_proj", state)
        assert back.type_name == blocks.type_name
        assert torch.equal(back.dequantize(), both.dequantize())
    assert GGUFBlocks.concat([q4_1[0], q8_0[0]]) is None  # types differ
    assert GGUFBlocks.concat([q4_1[0], q4_0[0]]) is None  # Q4_1 and Q4_0
    assert GGUFBlocks.concat([]) is None


def test_errors_name_the_problem(q4_1: tuple) -> None:
    raw = quantize(np.ones((4, 64), dtype=np.float32), GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match="whole 32-weight blocks"):
        GGUFBlocks.from_raw(raw, "Q4_1", (8, 48))
    with pytest.raises(ValueError, match="no block kernel"):
        GGUFBlocks.from_raw(raw, "Q5_K", (4, 64))
    with pytest.raises(ValueError, match="takes 320 bytes"):
        GGUFBlocks.from_raw(raw, "Q4_1", (8, 64))
    blocks = q4_1[0]
    state = blocks.to_state("p")
    state["p.gguf_type"] = torch.tensor([14], dtype=torch.uint8)  # Q6_K
    with pytest.raises(ValueError, match="not a GGUF block type"):
        GGUFBlocks.from_state("p", state)
    del state["p.gguf_type"]
    with pytest.raises(ValueError, match="gguf_type is missing"):
        GGUFBlocks.from_state("p", state)
    with pytest.raises(ValueError, match="takes no mins"):
        GGUFBlocks("Q8_0", torch.zeros(2, 1, 32, dtype=torch.int8), torch.ones(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match="fp32 CPU x"):
        gguf_linear(torch.zeros(2, 64), blocks)
    assert set(SUPPORTED_TYPES) == {"Q4_0", "Q4_1", "Q8_0", "Q4_K"}


def _check_gemm(y: torch.Tensor, x: torch.Tensor, blocks: GGUFBlocks) -> None:
    """y against float64 x @ W^T of the blocks' exact weights. Bound: the weights are exact in fp32 and each product
    x w and each partial sum is rounded at most once per step of a K-term sum in some order (fma or not), so
    |y - x W^T| <= gamma_K sum_k |x_k w_k|, gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and Stability
    of Numerical Algorithms, 2nd ed., eq. 3.5); the float64 reference's own error (K 2^-53 of the same sum) is far
    inside the slack."""
    w = blocks.dequantize().double()
    ref = x.double() @ w.T
    k = x.shape[1]
    u = 2.0 ** -24
    bound = (k * u / (1 - k * u)) * (x.double().abs() @ w.abs().T) + 1e-30
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"
    assert err.max().item() > 0 or x.shape[0] * blocks.shape[0] < 4  # fp32 sums do round: the check is not vacuous


def _row_slices(q4_1: tuple, q8_0: tuple, q4_0: tuple) -> list[GGUFBlocks]:
    # N = 299, 999, 197: odd, so neither the threads' 16-row grain nor the kernel's 2 and 4 W rows at a time divide
    # them: every tail path runs.
    return [q4_1[0].map_rows(lambda t: t[:299]), q8_0[0].map_rows(lambda t: t[:999]),
            q4_0[0].map_rows(lambda t: t[:197])]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_gguf_linear_within_fp32_rounding_of_float64(ops: object, q4_1: tuple, q8_0: tuple, q4_0: tuple, m: int,
                                                     threads: int) -> None:
    gen = torch.Generator().manual_seed(m)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # 2: the rows of W split in two uneven chunks
    try:
        for blocks in _row_slices(q4_1, q8_0, q4_0):
            x = torch.randn(m, blocks.shape[1], generator=gen)
            mins = torch.empty(0) if blocks.mins is None else blocks.mins
            _check_gemm(gguf_linear(x, blocks), x, blocks)
            # The portable form (the path of CPUs without AVX2), run here too.
            _check_gemm(ops.gguf_linear_portable(x, blocks.qs, blocks.scales, mins, blocks.type_code), x, blocks)
    finally:
        torch.set_num_threads(before)


def test_gguf_linear_on_real_activations(ops: object, reader: GGUFReader, q8_0: tuple, gguf_path: str,
                                         gsm8k_questions: list[str]) -> None:
    # Real hidden-like rows: the embedding rows of a real prompt's tokens, through a real Q4_1 projection (layer 0's
    # q_proj) and the real Q8_0 LM head (its first 1000 rows).
    ids = Tokenizer.from_gguf(gguf_path).encode(gsm8k_questions[0])[:17]
    emb = _tensor(reader, "token_embd.weight")
    x = GGUFBlocks.from_raw(emb.data[ids], "Q8_0", (len(ids), 576)).dequantize()
    q_proj, _ = _blocks(_tensor(reader, "blk.0.attn_q.weight"))
    for blocks in (q_proj, q8_0[0]):
        for m in (1, 5, len(ids)):
            _check_gemm(gguf_linear(x[:m].contiguous(), blocks), x[:m], blocks)


def test_torch_fallback_is_the_same_function(ops: object, q4_1: tuple, q8_0: tuple, q4_0: tuple,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    xs = {}
    built = {}
    for blocks in _row_slices(q4_1, q8_0, q4_0):
        xs[blocks.type_name] = x = torch.randn(6, blocks.shape[1], generator=gen)
        built[blocks.type_name] = gguf_linear(x, blocks)
    x = xs["Q4_1"].clone().requires_grad_()  # the op has no backward: x that requires grad takes the torch form
    blocks = _row_slices(q4_1, q8_0, q4_0)[0]
    y = gguf_linear(x, blocks)
    y.sum().backward()
    assert torch.equal(x.grad, blocks.dequantize().sum(0).expand_as(x))
    monkeypatch.setattr(engine.kernels.cpu_kernels, "cpu_ops", lambda: None)
    for blocks in _row_slices(q4_1, q8_0, q4_0):
        x = xs[blocks.type_name]
        fallback = gguf_linear(x, blocks)
        assert torch.equal(fallback, x @ blocks.dequantize().T)
        _check_gemm(fallback, x, blocks)
        # Both are the same weights summed in fp32: they agree within twice the bound of each.
        assert (fallback - built[blocks.type_name]).abs().max().item() < 1e-4


def test_op_rejects_bad_arguments(ops: object, q4_1: tuple) -> None:
    blocks = q4_1[0]
    x = torch.randn(2, blocks.shape[1])
    with pytest.raises(RuntimeError, match="type_code must be"):
        ops.gguf_linear(x, blocks.qs, blocks.scales, blocks.mins, 12)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        ops.gguf_linear(x[:, :64].contiguous(), blocks.qs, blocks.scales, blocks.mins, blocks.type_code)
    with pytest.raises(RuntimeError, match="qs must be"):
        ops.gguf_linear(x, blocks.qs, blocks.scales, blocks.mins, 8)  # Q4 bytes passed as Q8_0
    with pytest.raises(RuntimeError, match="mins must be"):
        ops.gguf_linear(x, blocks.qs, blocks.scales, torch.empty(0), blocks.type_code)


def _q4_k_raw(n: int, k: int, seed: int) -> np.ndarray:
    """Raw Q4_K bytes [n, k / 256 * 144] (gguf-py has no Q4_K quantizer): random nibbles and 6-bit scales/mins,
    finite fp16 d and dmin of a real model's size."""
    rng = np.random.default_rng(seed)
    nsb = n * k // 256
    raw = rng.integers(0, 256, size=(nsb, 144), dtype=np.uint8)
    raw[:, 0:2] = rng.normal(0, 2e-3, nsb).astype(np.float16).view(np.uint8).reshape(nsb, 2)
    raw[:, 2:4] = np.abs(rng.normal(0, 2e-3, nsb)).astype(np.float16).view(np.uint8).reshape(nsb, 2)
    return raw.reshape(n, k // 256 * 144)


def test_q4_k_super_blocks_are_q4_1_shaped_blocks_bit_for_bit(ops: object) -> None:
    n, k = 203, 1536  # odd N (every tail path), K = 6 super-blocks
    raw = _q4_k_raw(n, k, 0)
    blocks = GGUFBlocks.from_raw(raw, "Q4_K", (n, k))
    assert blocks.type_name == "Q4_K" and blocks.shape == (n, k) and blocks.kernel_code == TYPE_CODES["Q4_1"]
    ref = dequantize(raw, GGMLQuantizationType.Q4_K).reshape(n, k)
    np.testing.assert_array_equal(_bits(blocks.dequantize()), _bits(ref))  # the same weights, bit for bit
    for m in (1, 5, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        _check_gemm(gguf_linear(x, blocks), x, blocks)
    again = GGUFBlocks.from_state("w", blocks.to_state("w"))
    assert again.type_name == "Q4_K" and torch.equal(again.dequantize(), blocks.dequantize())
    with pytest.raises(ValueError, match="256-weight super-blocks"):
        GGUFBlocks.from_raw(raw, "Q4_K", (n * 6, 256 - 32))
