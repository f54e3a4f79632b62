"""engine.logits_processors on synthetic logits: logit_bias, min_tokens and the presence/frequency/repetition
penalties against their definitions (OpenAI's and vLLM's), raw logprobs taken before any of them, and rows that ask
for nothing left untouched."""

from __future__ import annotations

import math

import pytest
import torch

from engine.logits_processors import LogitsProcessors
from engine.request import Request
from engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 2


def _request(rid: str, sp: SamplingParams, prompt: list[int], output: list[int]) -> Request:
    r = Request(rid, prompt, sp)
    for t in output:
        r.append_output_token(t)
    return r


def test_penalties_bias_and_min_tokens_follow_their_definitions() -> None:
    procs = LogitsProcessors(None, VOCAB, [EOS])
    plain = _request("plain", SamplingParams(), [1, 2, 3], [4])
    pen = _request("pen", SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5,
                                         logprobs=2), [5, 6], [7, 7, 8])
    bias = _request("bias", SamplingParams(logit_bias={"9": 4.0, 10: -100}, min_tokens=3, stop_token_ids=(11,)),
                    [1], [3])
    for r in (plain, pen, bias):
        procs.add(r)
    assert set(procs.states) == {"pen", "bias"}  # nothing to do for `plain`: never registered
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    before = logits.clone()
    out, pending = procs.apply(logits.clone(), [plain, pen, bias])
    assert torch.equal(out[0], before[0])
    # vLLM's apply_penalties, element by element.
    expect = before[1].clone()
    for t in range(VOCAB):
        if t in (5, 6, 7, 8):
            expect[t] = expect[t] / 1.5 if expect[t] > 0 else expect[t] * 1.5
        count = [7, 7, 8].count(t)
        expect[t] -= 0.25 * count + 0.5 * (count > 0)
    torch.testing.assert_close(out[1], expect)
    assert out[2, 9] == pytest.approx(before[2, 9].item() + 4.0)
    assert out[2, 10] == pytest.approx(before[2, 10].item() - 100.0)
    assert out[2, EOS] == -math.inf and out[2, 11] == -math.inf  # 1 output token < min_tokens 3
    others = [t for t in range(VOCAB) if t not in (9, 10, EOS, 11)]
    assert torch.equal(out[2, others], before[2, others])
    # Raw logprobs: the log_softmax of the logits before the penalties.
    procs.record(pending, [0, 7, 9])
    lp = procs.states["pen"].logprobs[0]
    raw = before[1].log_softmax(-1)
    assert lp.token_id == 7 and lp.logprob == pytest.approx(raw[7].item(), abs=1e-6)
    assert [t for t, _ in lp.top] == raw.topk(2).indices.tolist()


def test_min_tokens_lifts_once_enough_tokens_are_out_and_nothing_is_active_after_pop() -> None:
    procs = LogitsProcessors(None, VOCAB, [EOS])
    r = _request("r", SamplingParams(min_tokens=2), [1], [3, 4])
    procs.add(r)
    logits = torch.zeros(1, VOCAB)
    out, _ = procs.apply(logits, [r])
    assert out[0, EOS] == 0.0
    procs.pop("r")
    assert not procs.active
    with pytest.raises(ValueError, match=r"logit_bias token ids \[64\] are outside the vocabulary \[0, 64\)"):
        procs.add(_request("x", SamplingParams(logit_bias={64: 1.0}), [1], []))


def test_out_of_range_values_name_the_field_and_the_range() -> None:
    with pytest.raises(ValueError, match=r"presence_penalty must be a number in \[-2, 2\]"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be a number in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(top_k=-1).top_k == -1  # vLLM's "off"
