"""Token sampling on the device, vectorized over the batch: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential-race form of the Gumbel-max trick: argmax(p / E) with E ~ Exp(1) draws from p
(Gumbel, 1954; as in vLLM's sampler). Top-p: Holtzman et al., ICLR 2020. Top-k: Fan et al., ACL 2018.

NOTE: a step costs a fixed number of batched tensor ops whatever the batch holds (no per-row kernels) and one
device->host sync (the final `tolist`). A seeded row's noise is a pure function of (seed, output index, token id)
and every op is row-wise, so its token does not depend on the other rows of the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.cpu_kernels import cpu_ops
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


def counter_exponentials(seeds: torch.Tensor, output_indices: torch.Tensor, vocab_size: int,
                         token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) noise that is a pure function of (seed, output index, token id): counter-based, as Philox (Salmon et
    al., SC 2011), so a seeded request draws the same noise alone, in any batch, and after preemption.

    seeds, output_indices: int64 [R] (a seed's bits mod 2^64). token_ids: int64 [R, W], the tokens to draw for,
    or None for the whole vocabulary (then W = vocab_size). Returns fp32 [R, W], every value > 0.
    One 64-bit hash per pair of tokens (2v, 2v+1) gives their two 32-bit uniforms, high half to the even token;
    E = -log1p(-u) with u = (k + 1/2) 2^-32 keeps fp32's full precision for the small E that win the race.
    """
    row_key = splitmix64(splitmix64(seeds) + output_indices)[:, None]  # [R, 1]
    if token_ids is None:
        half = (vocab_size + 1) // 2
        h = splitmix64(row_key + torch.arange(1, half + 1, device=seeds.device) * _i64(_GOLDEN))  # [R, half]
        bits = torch.empty((h.shape[0], half, 2), dtype=torch.float32, device=h.device)
        bits[..., 0] = _shr(h, 32)
        bits[..., 1] = h.bitwise_and_(_LOW32)
        bits = bits.flatten(1)[:, :vocab_size]
    else:
        h = splitmix64(row_key + ((token_ids >> 1) + 1) * _i64(_GOLDEN))  # [R, W]
        bits = torch.where((token_ids & 1).bool(), h & _LOW32, _shr(h, 32)).to(torch.float32)
    # u rounds to 1 with odds ~2^-25; E = inf then and that token just cannot win this draw.
    return bits.mul_(-(2.0**-32)).sub_(2.0**-33).log1p_().neg_()


def mask_top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's nucleus: the smallest prefix whose probability reaches top_p.

    sorted_logits: fp32 [R, W], each row in descending order (-inf allowed); top_p: fp32 [R], 1.0 keeps the row
    whole. Returns fp32 [R, W]. The top token always stays.
    """
    probs = sorted_logits.softmax(-1)
    # Drop a token when the tokens ranked above it already reach top_p. Rows with top_p = 1 keep everything
    # (fp32 cumsums can reach 1.0 before the tail does).
    drop = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
    return sorted_logits.masked_fill(drop, float("-inf"))


class _Rows(NamedTuple):
    """The sampled rows of one group and their parameters, on the device (all [R])."""

    rows: torch.Tensor  # int64: row of each in the step's logits
    top_k: torch.Tensor  # int64: k, or 0 when disabled
    seeds: torch.Tensor  # int64: the seed's bits (0 for unseeded rows)
    counters: torch.Tensor  # int64: how many output tokens the request already has
    temperature: torch.Tensor  # fp32
    top_p: torch.Tensor  # fp32
    is_seeded: list[bool]  # host
    any_top_p: bool  # host: some row has top_p < 1
    max_k: int  # host: the largest k


def _to_device(values: list[list[int]] | list[list[float]], dtype: torch.dtype, device: torch.device
               ) -> torch.Tensor:
    # Pinned and non-blocking: a pageable copy to CUDA would first wait for the forward pass (a hidden sync).
    t = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


def _gather_rows(rows: list[int], params: list[SamplingParams], output_indices: list[int], vocab: int,
                 device: torch.device) -> _Rows:
    sp = [params[i] for i in rows]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in sp]
    # One int64 [4, R] and one fp32 [2, R] copy carry every per-row parameter.
    ints = _to_device([rows, ks, [0 if p.seed is None else _i64(p.seed) for p in sp],
                       [output_indices[i] for i in rows]], torch.int64, device)
    floats = _to_device([[p.temperature for p in sp], [p.top_p for p in sp]], torch.float32, device)
    return _Rows(*ints.unbind(0), *floats.unbind(0), is_seeded=[p.seed is not None for p in sp],
                 any_top_p=any(p.top_p < 1.0 for p in sp), max_k=max(ks))


def _race_noise(g: _Rows, shape: tuple[int, int], vocab: int, token_ids: torch.Tensor | None,
                generator: torch.Generator) -> torch.Tensor:
    """Exp(1) noise fp32 `shape` ([R, W]): counter-based for seeded rows (at `token_ids` [R, W], or the whole
    vocabulary when None), one draw of the engine's generator for all the others."""
    device = g.rows.device
    if all(g.is_seeded):
        return counter_exponentials(g.seeds, g.counters, vocab, token_ids)
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    if any(g.is_seeded):
        seeded = _to_device([[j for j, s in enumerate(g.is_seeded) if s]], torch.int64, device)[0]
        ids = None if token_ids is None else token_ids.index_select(0, seeded)
        noise.index_copy_(0, seeded, counter_exponentials(g.seeds[seeded], g.counters[seeded], vocab, ids))
    return noise


def _sample_full(logits: torch.Tensor, g: _Rows, generator: torch.Generator) -> torch.Tensor:
    """Rows without top_k: the race over the whole vocabulary ([R, V]). Returns int64 [R] token ids."""
    x = logits.index_select(0, g.rows).float().div_(g.temperature[:, None])
    if g.any_top_p:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        x = x.scatter_(-1, order, mask_top_p_sorted(sorted_x, g.top_p))
    noise = _race_noise(g, tuple(x.shape), x.shape[-1], None, generator)
    return x.softmax(-1).div_(noise).argmax(dim=-1)


def _sample_top_k(logits: torch.Tensor, g: _Rows, generator: torch.Generator) -> torch.Tensor:
    """Rows with top_k: the race among each row's k best tokens only ([R, max_k]; the rest would be masked anyway),
    so top-p needs no sort of the vocabulary. Returns int64 [R] token ids."""
    values, ids = torch.topk(logits.index_select(0, g.rows), g.max_k, dim=-1)  # descending
    ranks = torch.arange(g.max_k, device=values.device)
    x = values.float().div_(g.temperature[:, None]).masked_fill_(ranks >= g.top_k[:, None], float("-inf"))
    if g.any_top_p:
        x = mask_top_p_sorted(x, g.top_p)
    noise = _race_noise(g, tuple(x.shape), logits.shape[-1], ids, generator)
    picked = x.softmax(-1).div_(noise).argmax(dim=-1, keepdim=True)
    return ids.gather(1, picked).squeeze(1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of [S, V] logits (first index on ties), int64 [S]. On the CPU the C++ kernel
    (engine.cpu_kernels `argmax_rows`: one vectorized pass for the max, one for its index) replaces torch's
    element-at-a-time reduction of bf16 rows (about 15x faster at 64 x 49,152); elsewhere torch's."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1 and not logits.requires_grad:
        ops = cpu_ops()
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
           generator: torch.Generator) -> list[int]:
    """Pick one token per row, all rows of a kind together.

    logits: [S, V], fp32 or the model's dtype (the argmax is exact in either; sampled rows are upcast to fp32 after
    they are selected, so a batch of greedy rows never converts the logits); params: S SamplingParams;
    output_indices: for each row, how many output tokens the request already has (with the seed, the counter of a
    seeded row's noise); generator: the engine's generator, drawn once per group for its unseeded sampled rows.
    Greedy rows take the argmax. Sampled rows are divided by their temperature, cut to their top_k (ties at the
    k-th broken by topk's order) and top_p nucleus, and drawn by one exponential race: rows with top_k as one
    [R, max k] group, the others as one [R, V] group.
    Returns S token ids (host ints; the one device->host sync of a step).
    """
    tokens = argmax_rows(logits)
    vocab = logits.shape[-1]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    with_k = [i for i in sampled if 0 < params[i].top_k < vocab]
    without_k = [i for i in sampled if not 0 < params[i].top_k < vocab]
    for rows, group_fn in ((with_k, _sample_top_k), (without_k, _sample_full)):
        if rows:
            g = _gather_rows(rows, params, output_indices, vocab, logits.device)
            tokens.index_copy_(0, g.rows, group_fn(logits, g, generator))
    return tokens.tolist()
