"""Greedy output of our engine is token-identical to HF transformers loading the same GGUF (fp32, CPU), and its
logprobs equal HF's log_softmax. One HF load (tens of CPU-seconds: HF dequantizes the GGUF in numpy) serves both
tests of this file.

HF is the reference for every one of the 8 prompts in one forward pass each (teacher forcing): HF's greedy output
equals ours exactly when, at every output position, HF's argmax after the prompt and our earlier tokens is our
token (by induction over the positions; and where we stopped early, on EOS, HF stops too). That is the check
`model.generate` makes, at a fraction of its cost (generate re-reads all the weights for each of 32 decode steps of
each prompt, one prompt at a time: 2.9 CPU-s a prompt). `model.generate` itself still runs on the first prompt, so
the check is also tied to HF's own decode loop and KV cache. The forward computes the LM head only at the positions
compared (HF's `logits_to_keep`, as its generate() does): the prompt's other rows would be thrown away.

Sizes: 8 real GSM8K prompts x 32 greedy tokens (256 positions compared) in a pool that forces preemption and
recompute (90 blocks of 4 for ~960 tokens; measured: 4 preemptions of 4 requests). Which positions match HF does not
depend on how many prompts share the batch; what the batch size changes is only whether the pool runs short, and
the test asserts that it did (32 prompts were the same check at 4x the CPU time of the call, 16 at 2x)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

NUM_PROMPTS = 8
MAX_TOKENS = 32
NUM_GENERATE = 1  # prompts that also go through HF's generate()


@pytest.fixture(scope="module")
def hf_model_and_tokenizer(gguf_path: str):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import gguf

    # transformers parses the GGUF's metadata with gguf.GGUFReader three times (tokenizer, config, weights; pure
    # Python over SmolLM2's 49k-token vocabulary, most of this fixture's CPU time); its readers only read, so one
    # parse serves the three. It also builds gguf's TensorNameMap for (arch, 30 layers) once per model parameter
    # (397 times, ~8 CPU-s): a pure function of its arguments whose result HF only looks names up in, so one build
    # serves them all. What HF builds from either is unchanged.
    parse, parsed = gguf.GGUFReader, {}
    name_map = functools.cache(gguf.get_tensor_name_map)

    def reader(path: str, *args: object) -> gguf.GGUFReader:
        key = (os.path.realpath(path), args)
        if key not in parsed:
            parsed[key] = parse(path, *args)
        return parsed[key]

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", name_map)
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    assert len(parsed) == 1, parsed  # the three reads shared one parse
    assert name_map.cache_info().hits > 100  # the name map was built once, not per parameter
    model.eval()
    return model, tok


def test_greedy_matches_hf_with_preemption(engine: LLMEngine, gsm8k_questions: list[str],
                                           hf_model_and_tokenizer) -> None:
    prompts = gsm8k_questions[:NUM_PROMPTS]
    # Small blocks so every prompt spans many of them; a pool far smaller than the batch needs, so the scheduler
    # must preempt and recompute. The session's real model (fp32, CPU) with this KV pool and these limits.
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, num_kv_blocks=90, max_num_seqs=32,
                       max_num_batched_tokens=512)
    tight = engine.with_config(cfg)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outs = tight.generate(prompts, params)

    assert tight.scheduler.num_preemptions >= 1
    assert all(o.num_prompt_tokens > 3 * cfg.block_size for o in outs)
    tight.kv_cache_manager.check_integrity()
    assert tight.kv_cache_manager.num_free_blocks == cfg.num_kv_blocks  # nothing leaked after a full run

    model, tok = hf_model_and_tokenizer
    mismatches = []
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        input_ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        assert input_ids[0].tolist() == out.prompt_token_ids
        ours = out.output_token_ids
        assert len(ours) == MAX_TOKENS or ours[-1] == tok.eos_token_id  # a greedy run stops only there
        n = input_ids.shape[1]
        with torch.inference_mode():
            # the last len(ours) + 1 positions' logits; the one after our last token is not compared
            logits = model(torch.tensor([out.prompt_token_ids + ours]), logits_to_keep=len(ours) + 1).logits[0, :-1]
        hf_greedy = logits.argmax(-1).tolist()  # HF's choice at each output position, given what came before
        if hf_greedy != ours:
            mismatches.append(("forward", prompt[:40], hf_greedy, ours))
        if i < NUM_GENERATE:
            with torch.inference_mode():
                ref = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            if ref[0, n:].tolist() != ours:
                mismatches.append(("generate", prompt[:40], ref[0, n:].tolist(), ours))
    assert not mismatches, mismatches


def test_logprobs_equal_hf_transformers(engine: LLMEngine, gsm8k_questions: list[str],
                                        hf_model_and_tokenizer) -> None:
    """Raw logprobs (before temperature and penalties) of sampled rows against HF's log_softmax of the same
    GGUF's logits (fp32), teacher-forced on our output tokens: within 1e-4."""
    prompts = gsm8k_questions[60:63]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=5, presence_penalty=0.5)
    outs = engine.generate(prompts, params)
    model, _ = hf_model_and_tokenizer
    for o in outs:
        assert o.logprobs is not None and len(o.logprobs) == o.num_output_tokens
        with torch.inference_mode():
            ref = model(torch.tensor([o.prompt_token_ids + o.output_token_ids]),
                        logits_to_keep=o.num_output_tokens + 1).logits[0, :-1].log_softmax(-1)
        for pos, entry in enumerate(o.logprobs):
            assert entry.token_id == o.output_token_ids[pos]
            assert abs(entry.logprob - ref[pos, entry.token_id].item()) < 1e-4
            values, ids = ref[pos].topk(5)
            assert [t.token_id for t in entry.top_logprobs] == ids.tolist()
            assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, values.tolist(), strict=True)) < 1e-4
            assert entry.token == engine.tokenizer.decode([entry.token_id], skip_special_tokens=False)
