"""The dense logits ops of engine.sample.logits_processors.LogitsProcessors.apply, in vLLM v1's order: logit_bias and
min_tokens (vLLM's LogitBiasLogitsProcessor and MinTokensLogitsProcessor), then the repetition, frequency and presence
penalties (vllm/model_executor/layers/utils.py `apply_penalties`). Each is one batched op over the step's rows that
ask for it; the per-request state (matchers, logprobs) stays in engine.sample.logits_processors.
"""

from __future__ import annotations

import torch

from engine.core.request import Request
from engine.sampling_params import SamplingParams


def apply_bias_and_min_tokens(logits: torch.Tensor, rows: list[tuple[int, SamplingParams, tuple[int, ...]]],
                              requests: list[Request], vocab_size: int) -> None:
    """Add each row's logit_bias and set its stop ids to -inf while it has fewer than min_tokens output tokens, in
    place, in one index_put each.

    Args:
        logits: fp32 [S, V] logits of the step (modified in place).
        rows: (row of `logits`, its SamplingParams, its stop ids) of each registered row.
        requests: the step's requests, row i sampling requests[i].
        vocab_size: V; stop ids at or above it are ignored.
    """
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    mask_r: list[int] = []
    mask_t: list[int] = []
    for i, params, stop_ids in rows:
        for tid, b in params.logit_bias:
            bias_r.append(i)
            bias_t.append(tid)
            bias_v.append(b)
        if requests[i].num_output_tokens < params.min_tokens:
            ids = [t for t in stop_ids if t < vocab_size]
            mask_r.extend([i] * len(ids))
            mask_t.extend(ids)
    dev = logits.device
    if bias_r:
        logits.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                          torch.tensor(bias_v, dtype=logits.dtype, device=dev), accumulate=True)
    if mask_r:
        logits.index_put_((torch.tensor(mask_r, device=dev), torch.tensor(mask_t, device=dev)),
                          torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))


def apply_penalties(logits: torch.Tensor, rows: list[tuple[int, SamplingParams]], requests: list[Request],
                    vocab_size: int) -> None:
    """vLLM's apply_penalties on the penalized rows, in place: repetition over prompt and output tokens, frequency and
    presence over output tokens; counts of output tokens by one scatter_add, presence of prompt tokens by one scatter.

    Args:
        logits: fp32 [S, V] logits of the step (modified in place).
        rows: (row of `logits`, its SamplingParams) of each registered row; rows without a penalty are skipped.
        requests: the step's requests, row i sampling requests[i].
        vocab_size: V.
    """
    pen = [(i, p) for i, p in rows
           if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not pen:
        return
    dev, v = logits.device, vocab_size
    idx = torch.tensor([i for i, _ in pen], device=dev)

    def padded(seqs: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(s) for s in seqs))
        return torch.tensor([s + [v] * (width - len(s)) for s in seqs], dtype=torch.int64, device=dev)

    out = padded([requests[i].output_token_ids for i, _ in pen])
    counts = torch.zeros(len(pen), v + 1, device=dev).scatter_add_(1, out, torch.ones(out.shape, device=dev))
    counts = counts[:, :v]
    out_mask = counts > 0
    prompt_mask = torch.zeros(len(pen), v + 1, dtype=torch.bool, device=dev)
    prompt_mask.scatter_(1, padded([requests[i].prompt_token_ids for i, _ in pen]), True)
    params = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for _, p in pen],
                          dtype=torch.float32, device=dev)
    sub = logits.index_select(0, idx)
    rep = torch.where(prompt_mask[:, :v] | out_mask, params[:, 0:1], 1.0)
    sub = torch.where(sub > 0, sub / rep, sub * rep)
    sub -= params[:, 1:2] * counts
    sub -= params[:, 2:3] * out_mask
    logits.index_copy_(0, idx, sub)
