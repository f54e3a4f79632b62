"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential-race form of the Gumbel-max trick: argmax(p / E) with E ~ Exp(1) draws from p
(Gumbel, 1954; as in vLLM's sampler). Top-p: Holtzman et al., ICLR 2020. Top-k: Fan et al., ACL 2018.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) pairs over the seed space


def _token_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    """A generator that depends only on (seed, index of the output token), so a seeded request draws the same
    tokens whatever else is in the batch and after preemption."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * _SEED_MIX + output_index) % (1 << 63))
    return g


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) all but the top_k logits and the smallest top_p nucleus. logits: fp32 [V] -> [V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
           generator: torch.Generator) -> list[int]:
    """Pick one token per row.

    logits: fp32 [S, V]; params: S SamplingParams; output_indices: for each row, how many output tokens the request
    already has (seeds the per-token generator); generator: the engine's generator for unseeded rows.
    Returns S token ids (host ints; the one device->host sync of a step).
    """
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    for i in sampled_rows:
        p = params[i]
        row = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        g = generator if p.seed is None else _token_generator(p.seed, output_indices[i], logits.device)
        noise = torch.empty_like(probs).exponential_(generator=g)
        tokens[i] = (probs / noise).argmax()
    return tokens.tolist()
