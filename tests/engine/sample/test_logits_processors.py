"""engine.sample.logits_processors on synthetic logits: logit_bias, min_tokens and the presence/frequency/repetition
penalties against their definitions (OpenAI's and vLLM's), raw logprobs taken before any of them, and rows that ask
for nothing left untouched."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.request import Request
from engine.sample.logits_processors import LogitsProcessors
from engine.sampling_params import SamplingParams, StructuredOutputsParams

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


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [vocab]: bit j of word w (token 32 w + j) of one xgrammar bitmask row."""
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].bool()


def test_the_bitmask_masks_exactly_the_constrained_rows_in_one_batch(gguf_path: str) -> None:
    import xgrammar as xgr

    from engine.sample.structured_output import StructuredOutputManager
    from engine.text.tokenizer import Tokenizer

    vocab = 49152
    tokenizer = Tokenizer.from_gguf(gguf_path)
    manager = StructuredOutputManager(tokenizer.hf_tokenizer, vocab, [EOS])
    procs = LogitsProcessors(manager, vocab, [EOS])
    choice = StructuredOutputsParams(choices=("positive", "negative", "neutral"))
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]+")
    reqs = [_request("plain0", SamplingParams(), [1], []), _request("choice", SamplingParams(structured_outputs=choice),
            [1], []), _request("plain2", SamplingParams(), [1], []),
            _request("regex", SamplingParams(structured_outputs=regex), [1], [])]
    for r in reqs:
        procs.add(r)
    torch.manual_seed(0)
    logits = torch.randn(4, vocab)
    out, pending = procs.apply(logits.clone(), reqs)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])  # unconstrained rows untouched
    ref = xgr.allocate_token_bitmask(1, vocab)
    for row, spec in ((1, choice), (3, regex)):
        xgr.GrammarMatcher(manager.grammar(spec)).fill_next_token_bitmask(ref, 0)
        allowed = _allowed(ref[0], vocab)
        assert 0 < int(allowed.sum()) < vocab // 10  # the grammar's first tokens: few of the vocabulary
        assert torch.equal(out[row][allowed], logits[row][allowed])
        assert bool(torch.isneginf(out[row][~allowed]).all())
    tokens = out.argmax(-1).tolist()
    procs.record(pending, tokens)
    assert not procs.states["choice"].rejected and not procs.states["regex"].rejected
    assert tokenizer.decode([tokens[3]])[0].isdigit()  # the regex row's first token starts with a digit
    # Every row constrained (one bitmask application for the whole batch, no row list): the same masks.
    both = [reqs[1], reqs[3]]
    fresh = LogitsProcessors(manager, vocab, [EOS])
    for r in both:
        fresh.add(r)
    out2, _ = fresh.apply(logits[[1, 3]].clone(), both)
    assert torch.equal(out2, out[[1, 3]])


def test_the_bitmask_backend_is_the_device_kernel_on_cuda() -> None:
    from engine.sample.logits_processors import bitmask_backend

    assert bitmask_backend(torch.device("cpu")) == "cpu"
    try:
        import triton  # noqa: F401
        expected = "triton"
    except ImportError:
        expected = "torch_native"
    assert bitmask_backend(torch.device("cuda")) == expected
    with pytest.raises(ValueError, match="structured outputs run on cpu or cuda logits, not mps"):
        bitmask_backend(torch.device("mps"))
