"""engine.sample.sampler on synthetic logits: greedy, per-request seeds whatever the batch, top-k, top-p, temperature,
and
the empirical distribution of the draws against softmax; every test runs on both paths (the C++ kernel of the CPU
and the torch ops of other devices), and the two paths draw the same tokens."""

from __future__ import annotations

import pytest
import torch

import engine.sample.sampler
from engine.kernels.cpu_kernels import cpu_ops
from engine.sample.sampler import counter_uniforms, sample, splitmix64
from engine.sampling_params import SamplingParams

VOCAB = 512


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def sampler_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test on the C++ kernel (engine.kernels.cpu_kernels sample_rows) and on the torch ops."""
    if request.param == "kernel" and cpu_ops() is None:
        pytest.skip("the CPU kernels cannot be built here")
    if request.param == "torch":
        monkeypatch.setattr(engine.sample.sampler, "cpu_ops", lambda: None)
    return request.param


def _splitmix64_reference(state: int) -> int:
    """Vigna's splitmix64.c next(), one step from `state`, in Python's unbounded ints."""
    m = (1 << 64) - 1
    z = (state + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3.0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `tokens` against `probs` [V] over the tokens with expected count >= 5, and its
    degrees of freedom; tokens of probability 0 must never appear."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    assert counts[expected == 0].sum() == 0, "a token outside the support was drawn"
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


# Upper 0.1% points of chi-square (df -> value): the draws are deterministic (fixed seeds), so this is a bound on
# a bias, not a flaky coin.
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _assert_matches(tokens: list[int], probs: torch.Tensor) -> None:
    stat, df = _chi_square(tokens, probs)
    assert stat < _CHI2_999[df], f"chi-square {stat:.1f} with {df} df: draws do not follow the probabilities"


def test_splitmix64_matches_the_reference_bits() -> None:
    states = [0, 1, 2, 12345, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0x0123456789ABCDEF, 0xDEADBEEFCAFEBABE]
    signed = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in states], dtype=torch.int64)
    got = [v & ((1 << 64) - 1) for v in splitmix64(signed).tolist()]
    assert got == [_splitmix64_reference(s) for s in states]


def test_counter_uniforms_are_uniform_and_a_function_of_seed_and_index() -> None:
    seeds = torch.tensor([0, 1, -5, 1 << 62])
    counters = torch.tensor([0, 7, 3, 100])
    u = counter_uniforms(seeds, counters)
    assert u.dtype == torch.float64 and torch.equal(u, counter_uniforms(seeds.clone(), counters.clone()))
    assert len(set(u.tolist())) == 4
    big = counter_uniforms(torch.arange(20_000), torch.zeros(20_000, dtype=torch.int64))
    assert bool((big >= 0).all()) and bool((big < 1).all())
    assert abs(big.mean().item() - 0.5) < 0.01 and abs((big < 0.1).double().mean().item() - 0.1) < 0.01
    along = counter_uniforms(torch.full((20_000,), 7), torch.arange(20_000))  # one seed, its output indices
    assert abs(along.mean().item() - 0.5) < 0.01


def test_the_kernel_and_the_torch_ops_draw_the_same_tokens(monkeypatch: pytest.MonkeyPatch,
                                                           sampler_path: str) -> None:
    """Same logits (bf16, as the model gives them), params and uniforms: the same tokens on both paths, but for
    the rare u that falls within rounding of a boundary between two tokens."""
    if sampler_path == "torch" or cpu_ops() is None:
        pytest.skip("compares the kernel with the torch ops once")
    logits = (_logits(256, 4096, seed=3) * 1.5).to(torch.bfloat16)
    kinds = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2),
             SamplingParams(temperature=0.8, top_k=50, seed=3), SamplingParams(temperature=1.2, top_k=200, top_p=0.95),
             SamplingParams(temperature=0.5, top_p=0.5), SamplingParams()]
    params = [kinds[i % len(kinds)] for i in range(256)]
    differ = 0
    for step in range(8):
        kernel = sample(logits, params, [step] * 256, _gen(step))
        with monkeypatch.context() as m:
            m.setattr(engine.sample.sampler, "cpu_ops", lambda: None)
            ops = sample(logits, params, [step] * 256, _gen(step))
        differ += sum(a != b for a, b in zip(kernel, ops, strict=True))
    assert differ <= 2, f"{differ} of 2048 draws differ between the kernel and the torch ops"


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    logits = _logits(6)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0, top_p=0.5),
              SamplingParams(temperature=0.7, top_k=20), SamplingParams(), SamplingParams(temperature=1.2, top_p=0.9)]
    tokens = sample(logits, params, [0] * 6, _gen())
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert sample(logits, [SamplingParams()] * 6, [0] * 6, _gen()) == argmax


def test_a_seeded_request_draws_the_same_tokens_alone_or_in_any_batch() -> None:
    """Across 40 output indices (as after a preemption the counters pick up where they were) and three batch
    compositions: alone, with greedy / unseeded / other-seeded / top-k / top-p rows, and in reverse order."""
    row = _logits(1, seed=1)[0]
    mine = [SamplingParams(temperature=1.0, seed=42), SamplingParams(temperature=0.8, top_p=0.9, seed=42),
            SamplingParams(temperature=1.3, top_k=40, top_p=0.95, seed=2**63 - 7)]
    others = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, seed=43),
              SamplingParams(temperature=1.1, top_k=5), SamplingParams(temperature=1.0, top_p=0.5, seed=1)]
    other_logits = _logits(len(others), seed=2)
    for p in mine:
        alone = [sample(row[None], [p], [i], _gen(i))[0] for i in range(40)]
        mixed, reverse = [], []
        for i in range(40):
            logits = torch.cat([other_logits, row[None]])
            mixed.append(sample(logits, [*others, p], [i + 3] * len(others) + [i], _gen(100 + i))[-1])
            flipped = torch.cat([row[None], other_logits.flip(0)])
            reverse.append(sample(flipped, [p, *others[::-1]], [i] + [i * 2] * len(others), _gen(7))[0])
        assert alone == mixed == reverse
        assert len(set(alone)) > 3, "the draws do not vary with the output index"


def test_seeds_differ_and_the_engine_generator_draws_the_unseeded_rows() -> None:
    logits = (_logits(1) / 3.0).expand(64, VOCAB)  # N(0, 1) logits: about 55 distinct tokens expected in 64 draws
    seeded = sample(logits, [SamplingParams(temperature=1.0, seed=s) for s in range(64)], [0] * 64, _gen())
    assert len(set(seeded)) > 10
    unseeded = [SamplingParams(temperature=1.0)] * 64
    assert sample(logits, unseeded, [0] * 64, _gen(1)) == sample(logits, unseeded, [0] * 64, _gen(1))
    assert sample(logits, unseeded, [0] * 64, _gen(1)) != sample(logits, unseeded, [0] * 64, _gen(2))


@pytest.mark.parametrize("seed", [None, 11])
def test_top_k_one_and_a_tiny_top_p_are_greedy(seed: int | None) -> None:
    logits = _logits(32)
    argmax = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=2.0, top_k=1, seed=seed), SamplingParams(temperature=2.0, top_p=1e-6,
                                                                                   seed=seed),
              SamplingParams(temperature=2.0, top_k=10, top_p=1e-6, seed=seed)):
        assert sample(logits, [p] * 32, list(range(32)), _gen()) == argmax


def test_top_k_keeps_only_the_k_best() -> None:
    logits = _logits(16)
    top5 = torch.topk(logits, 5).indices.tolist()
    for i in range(20):
        tokens = sample(logits, [SamplingParams(temperature=5.0, top_k=5, seed=s) for s in range(16)], [i] * 16,
                        _gen())
        assert all(t in top5[r] for r, t in enumerate(tokens))


def _softmax_draws(logits: torch.Tensor, params: list[SamplingParams], n: int) -> list[int]:
    """n draws for one row of `logits` [V]: n seeds in one batch for seeded params, else n unseeded rows."""
    batch = logits[None].expand(n, -1).contiguous()
    return sample(batch, params, [0] * n, _gen(5))


@pytest.mark.parametrize("seeded", [True, False])
def test_draws_follow_softmax_over_seeds(seeded: bool) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.7])
    n = 40_000
    params = [SamplingParams(temperature=1.0, seed=s if seeded else None) for s in range(n)]
    _assert_matches(_softmax_draws(logits, params, n), logits.softmax(-1))


def test_draws_follow_softmax_over_output_indices_of_one_seed() -> None:
    logits = torch.tensor([1.5, 1.0, 0.2, -0.3, 0.0, -1.0])
    n = 30_000
    tokens = sample(logits[None].expand(n, -1).contiguous(), [SamplingParams(temperature=1.0, seed=123)] * n,
                    list(range(n)), _gen())
    _assert_matches(tokens, logits.softmax(-1))


def test_top_k_and_top_p_draw_from_the_renormalized_head() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    probs = logits.softmax(-1)
    n = 30_000
    top3 = torch.zeros_like(probs)
    top3[:3] = probs[:3] / probs[:3].sum()
    _assert_matches(_softmax_draws(logits, [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(n)], n),
                    top3)
    # Nucleus 0.7: the smallest head reaching 0.7 (cumulative 0.40, 0.65, 0.80: the first three tokens).
    cum = probs.cumsum(0)
    size = int((cum < 0.7).sum()) + 1
    head = torch.zeros_like(probs)
    head[:size] = probs[:size] / probs[:size].sum()
    _assert_matches(_softmax_draws(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=s) for s in range(n)], n),
                    head)
    # Both: top_k 5 first, then the nucleus of what is left.
    p5 = probs[:5] / probs[:5].sum()
    size5 = int((p5.cumsum(0) < 0.8).sum()) + 1
    both = torch.zeros_like(probs)
    both[:size5] = p5[:size5] / p5[:size5].sum()
    params = [SamplingParams(temperature=1.0, top_k=5, top_p=0.8, seed=s) for s in range(n)]
    _assert_matches(_softmax_draws(logits, params, n), both)


def test_temperature_sharpens_or_flattens_the_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    n = 30_000
    share_of_best = []
    for t in (0.3, 1.0, 3.0):
        tokens = _softmax_draws(logits, [SamplingParams(temperature=t, seed=s) for s in range(n)], n)
        _assert_matches(tokens, (logits / t).softmax(-1))
        share_of_best.append(tokens.count(0) / n)
    assert share_of_best[0] > share_of_best[1] > share_of_best[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype: torch.dtype) -> None:
    """engine.sample.sampler.argmax_rows (fp32: numpy's argmax on the tensor's memory; bf16: the C++ kernel) equals
    torch.argmax: ties to the first index, an all -inf row to 0, the first NaN of a row wins; strided rows."""
    gen = torch.Generator().manual_seed(0)
    for rows, cols in [(64, 49152), (512, 512), (7, 37), (1, 1)]:
        x = torch.randn(rows, cols, generator=gen).to(dtype)
        x[0, cols // 2] = x[0].max()
        if rows > 2:
            x[1] = float("-inf")
            x[2, -1] = x[2, cols // 3] = float("nan")
        got = engine.sample.sampler.argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), (dtype, rows, cols)
    wide = torch.randn(4, 100, generator=gen).to(dtype)
    assert torch.equal(engine.sample.sampler.argmax_rows(wide[:, 10:90]), wide[:, 10:90].argmax(dim=-1))
    with torch.inference_mode():  # as the model runner calls it
        logits = torch.randn(8, 300, generator=gen).to(dtype)
        assert engine.sample.sampler.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
