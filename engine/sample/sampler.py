"""Token sampling on the device, vectorized over the batch: greedy, temperature, top-k, top-p, per-request seeds.

A sampled row is drawn by the inverse CDF: its logits divided by the temperature become probabilities, cut to the
top_k best and then the top_p nucleus (tokens ranked by probability, ties by lower id; Holtzman et al., ICLR 2020;
top-k: Fan et al., ACL 2018), and one uniform u in [0, 1) picks, walking the kept tokens in token-id order, the
first whose cumulative probability exceeds u times the kept mass. On the CPU a C++ kernel (engine.kernels.cpu_kernels
`sample_rows`) does a row in a few vectorized passes and finds the nucleus from a histogram of the probability mass
(no sort of the vocabulary); elsewhere the same function in torch ops (a sort only when a row has top_k or top_p).
Their draws agree except where u falls within rounding (~1e-7) of a boundary between two tokens.

NOTE: a step costs a fixed number of batched ops whatever the batch holds (no per-row Python) and one device->host
sync (the final `tolist`). A seeded row's uniform is a pure function of (seed, output index) (counter_uniforms)
and every op is row-wise, so its token does not depend on the other rows of the batch, nor on a preemption.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.kernels.cpu_kernels import cpu_ops
from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment, 2^64 / golden ratio
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LOW32 = 0xFFFFFFFF


def _i64(c: int) -> int:
    """The int64 (two's complement) with the bits of `c` mod 2^64 (Python ints of any size and sign)."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def seed_bits(seed: int) -> int:
    """A request's seed as the int64 the sampler hashes (its bits mod 2^64)."""
    return _i64(seed)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: it copies the sign bit in)."""
    return (x >> k).bitwise_and_((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 (Steele, Lea & Flood, OOPSLA 2014; constants of Vigna's splitmix64.c) of each int64 state: the
    state plus the golden increment, then the output mix. int64 -> int64 holding the unsigned result's bits; a
    bijection whose outputs for consecutive states pass BigCrush. Relies on int64 arithmetic wrapping mod 2^64,
    as torch's does on CPU and CUDA."""
    x = x + _i64(_GOLDEN)  # the one new tensor; the rest runs in place
    x.bitwise_xor_(_shr(x, 30)).mul_(_i64(_MIX1))
    x.bitwise_xor_(_shr(x, 27)).mul_(_i64(_MIX2))
    return x.bitwise_xor_(_shr(x, 31))


def counter_uniforms(seeds: torch.Tensor, output_indices: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) that are a pure function of (seed, output index): counter-based, as Philox (Salmon et al.,
    SC 2011), so a seeded request draws the same token alone, in any batch, and after preemption.

    seeds, output_indices: int64 [R] (a seed's bits mod 2^64). Returns fp64 [R]: the top 53 bits of
    splitmix64(splitmix64(seed) + output index), times 2^-53.
    """
    h = splitmix64(splitmix64(seeds) + output_indices)
    return _shr(h, 11).to(torch.float64).mul_(2.0**-53)


class SampledRows(NamedTuple):
    """The rows of a step that sample (not greedy) and their parameters, host numpy arrays [R].

    The persistent batch (engine.worker.input_batch.InputBatch.sampled_rows) slices them from arrays written once when a
    request joins; `from_params` builds them from SamplingParams (tests, benchmarks)."""

    rows: np.ndarray  # int64: row of each in the step's logits
    temperature: np.ndarray  # fp32 (> 0)
    top_p: np.ndarray  # fp32
    top_k: np.ndarray  # int64: k as given (0 or -1 off; a k >= the vocabulary is off too)
    seed: np.ndarray  # int64: the seed's bits mod 2^64, 0 where unseeded
    seeded: np.ndarray  # bool
    output_index: np.ndarray  # int64: output tokens the request already has (the seeded uniform's counter)

    @classmethod
    def from_params(cls, params: list[SamplingParams], output_indices: list[int]) -> SampledRows | None:
        """The non-greedy rows of `params` (S SamplingParams, with S output indices), or None when all are greedy.
        """
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return None
        sp = [params[i] for i in rows]
        return cls(np.array(rows, dtype=np.int64), np.array([p.temperature for p in sp], dtype=np.float32),
                   np.array([p.top_p for p in sp], dtype=np.float32), np.array([p.top_k for p in sp], dtype=np.int64),
                   np.array([0 if p.seed is None else seed_bits(p.seed) for p in sp], dtype=np.int64),
                   np.array([p.seed is not None for p in sp], dtype=bool),
                   np.array([output_indices[i] for i in rows], dtype=np.int64))


class _Rows(NamedTuple):
    """The sampled rows of a step and their parameters, on the device (all [R])."""

    rows: torch.Tensor  # int64: row of each in the step's logits
    top_k: torch.Tensor  # int64: k, or 0 when disabled
    temperature: torch.Tensor  # fp32
    top_p: torch.Tensor  # fp32
    u: torch.Tensor  # fp64: the row's uniform in [0, 1)
    any_cut: bool  # host: some row has top_k or top_p < 1
    max_k: int  # host: the largest k, 0 when some cut row has no top_k (then the whole row is ranked)


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    # Pinned and non-blocking: a pageable copy to CUDA would first wait for the forward pass (a hidden sync).
    t = torch.from_numpy(values)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _gather_rows(g: SampledRows, vocab: int, device: torch.device, generator: torch.Generator) -> _Rows:
    """The rows' parameters on the device, and their uniforms: counter_uniforms for seeded rows, one draw of the
    engine's generator for the others."""
    ks = np.where((g.top_k > 0) & (g.top_k < vocab), g.top_k, 0)
    # One int64 [4, R] and one fp32 [2, R] copy carry every per-row parameter.
    ints = _to_device(np.stack([g.rows, ks, g.seed, g.output_index]), device)
    floats = _to_device(np.stack([g.temperature, g.top_p]), device)
    row_ids, top_k, seeds, counters = ints.unbind(0)
    if g.seeded.all():
        u = counter_uniforms(seeds, counters)
    else:
        u = torch.empty(len(g.rows), dtype=torch.float64, device=device).uniform_(generator=generator)
        if g.seeded.any():
            u = torch.where(_to_device(g.seeded, device), counter_uniforms(seeds, counters), u)
    cut = (ks > 0) | (g.top_p < 1.0)
    max_k = 0 if bool((cut & (ks == 0)).any()) else int(ks.max())
    return _Rows(row_ids, top_k, *floats.unbind(0), u, any_cut=bool(cut.any()), max_k=max_k)


def _pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of unnormalized weights fp32 [R, W] (>= 0), the first position whose cumulative weight exceeds
    u [R] times the row's total (sums in fp64). Returns int64 [R, 1]."""
    cdf = weights.double().cumsum_(-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)


def _sample_torch(logits: torch.Tensor, g: _Rows) -> torch.Tensor:
    """The torch ops of the sampler (see the module docstring). Returns int64 [R] token ids."""
    probs = logits[g.rows].float().div_(g.temperature[:, None]).softmax(-1)  # [R, V]
    if not g.any_cut:
        return _pick(probs, g.u).squeeze(1)
    if g.max_k:  # every cut row has a top_k: rank only the max_k best
        ranked, ids = torch.topk(probs, g.max_k, dim=-1)
        # Ties ranked by token id, as the kernel does (bf16 logits tie often; topk's order of ties is unspecified):
        # it decides which tied token the nucleus keeps.
        ids, by_id = ids.sort(dim=-1)
        ranked, order = ranked.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, order)
    else:
        ranked, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    ranks = torch.arange(ranked.shape[-1], device=ranked.device)
    k = torch.where(g.top_k > 0, g.top_k, ranked.shape[-1])
    ranked = ranked.masked_fill_(ranks >= k[:, None], 0.0)
    # Keep a token while the tokens ranked above it hold less than top_p of the (top_k) mass.
    cum = ranked.double().cumsum(-1)
    before = cum - ranked.double()
    drop = (before >= (g.top_p.double() * cum[:, -1])[:, None]) & (g.top_p < 1.0)[:, None]
    ranked = ranked.masked_fill_(drop, 0.0)
    kept = torch.zeros_like(probs).scatter_(1, ids, ranked)  # back in token-id order, the order of the walk
    cut = (g.top_k > 0) | (g.top_p < 1.0)
    return _pick(torch.where(cut[:, None], kept, probs), g.u).squeeze(1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of [S, V] logits (first index on ties, the first NaN where a row has one), int64
    [S]. On the CPU, fp32 rows: numpy's argmax (SIMD, on the tensor's memory), faster than the C++ kernel's AVX2
    form; other dtypes (bf16, fp16): the C++ kernel (engine.kernels.cpu_kernels `argmax_rows`: one vectorized pass
    for the max, one for its index), which replaces torch's element-at-a-time reduction of bf16 rows; elsewhere
    torch's (figures: bench/README.md "Figures once quoted in engine/'s docstrings")."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1 and not logits.requires_grad:
        if logits.dtype == torch.float32:
            return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))
        ops = cpu_ops()
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
           generator: torch.Generator) -> list[int]:
    """Pick one token per row: greedy rows the argmax, sampled rows by the inverse CDF (module docstring).

    logits: [S, V], fp32 or the model's dtype (the argmax is exact in either; sampled rows are upcast to fp32 after
    they are selected, so a batch of greedy rows never converts the logits); params: S SamplingParams;
    output_indices: for each row, how many output tokens the request already has (with the seed, the counter of a
    seeded row's uniform); generator: the engine's generator, drawn once per step for the unseeded sampled rows.
    Returns S token ids (host ints; the one device->host sync of a step).
    """
    return sample_rows(logits, SampledRows.from_params(params, output_indices), generator)


def sample_rows(logits: torch.Tensor, sampled: SampledRows | None, generator: torch.Generator) -> list[int]:
    """`sample` with the non-greedy rows given as arrays (None: every row greedy), as the model runner passes them
    from the persistent batch: a greedy step is the argmax and one `tolist`, no per-row Python."""
    return sample_rows_on_device(logits, sampled, generator).tolist()


def sample_rows_on_device(logits: torch.Tensor, sampled: SampledRows | None, generator: torch.Generator
                          ) -> torch.Tensor:
    """`sample_rows` without the device->host sync: the S sampled token ids as an int64 [S] tensor on the logits'
    device (the runner's asynchronous steps copy it to the host while the next step runs)."""
    tokens = argmax_rows(logits)
    if sampled is not None:
        g = _gather_rows(sampled, logits.shape[-1], logits.device, generator)
        ops = cpu_ops() if logits.device.type == "cpu" and logits.stride(-1) == 1 else None
        if ops is not None:
            picked = ops.sample_rows(logits, g.rows, g.temperature, g.top_k, g.top_p, g.u)
        else:
            picked = _sample_torch(logits, g)
        tokens.index_copy_(0, g.rows, picked)
    return tokens
