"""The caches of image prompts: prefix-cache block keys carry the mm hashes of the images a block holds (one image
asked several questions computes its KV once; another image with the same placeholder tokens never takes those
blocks), the encoder cache runs each image once across the chunks of a prefill split inside its placeholders and
across rows, and its budget evicts freed entries first."""

from __future__ import annotations

import torch
from llava_models import MAX_TOKENS, hf_greedy, picture

from engine import EngineConfig, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import MultiModalItem

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32")


def _chat(n: int, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": text}]}]


def _hf(hf_llava, prompt: dict) -> list[int]:
    model, processor = hf_llava
    return hf_greedy(model, processor, _chat(len(prompt["images"]), prompt["prompt"]), prompt["images"], MAX_TOKENS)[1]


def test_one_image_asked_several_questions_hits_the_prefix_cache(llava_engine, hf_llava, questions) -> None:
    engine = llava_engine.with_config(EngineConfig(**CPU))
    image = picture("RGB", (80, 60), 21)
    first = engine.generate([{"prompt": questions[0], "images": [image]}], GREEDY)[0]
    pool = engine.kv_cache_manager.pool
    hits, encoded = pool.num_cache_hits, engine.runner.images.cache.num_encoded
    prompts = [{"prompt": q, "images": [image]} for q in questions[1:4]]
    outs = engine.generate(prompts, GREEDY)
    # Block 0 ("USER: " and the image's first 13 placeholders) is shared by every row; the later ones differ.
    assert pool.num_cache_hits - hits == 3
    assert engine.runner.images.cache.num_encoded == encoded == 1  # the image's features kept, not encoded again
    for prompt, out in zip([{"prompt": questions[0], "images": [image]}, *prompts], [first, *outs], strict=True):
        assert out.output_token_ids == _hf(hf_llava, prompt)


def test_another_image_with_the_same_tokens_misses(llava_engine, hf_llava, questions) -> None:
    engine = llava_engine.with_config(EngineConfig(**CPU))
    a, b = picture("RGB", (80, 60), 22), picture("RGB", (80, 60), 23)
    out_a = engine.generate([{"prompt": questions[4], "images": [a]}], GREEDY)[0]
    hits = engine.kv_cache_manager.pool.num_cache_hits
    prompt_b = {"prompt": questions[4], "images": [b]}
    out_b = engine.generate([prompt_b], GREEDY)[0]
    assert out_b.prompt_token_ids == out_a.prompt_token_ids  # the same tokens: only the pixels differ
    assert engine.kv_cache_manager.pool.num_cache_hits == hits
    assert out_b.output_token_ids == _hf(hf_llava, prompt_b) != out_a.output_token_ids


def test_chunked_prefill_inside_an_image_encodes_it_once(llava_engine, hf_llava, questions) -> None:
    """5-token steps: every image's 16 placeholders span four chunks over as many steps (with asynchronous
    scheduling on, the launch path), and each image is encoded once."""
    engine = llava_engine.with_config(EngineConfig(**CPU, max_num_batched_tokens=5, enable_prefix_caching=False,
                                                   async_scheduling=True))
    prompts = [{"prompt": questions[2], "images": [picture("RGB", (50, 70), 24), picture("L", (70, 50), 25)]},
               {"prompt": questions[3], "images": [picture("RGBA", (66, 66), 26)]}]
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_token_ids == _hf(hf_llava, prompt)
    assert engine.runner.images.cache.num_encoded == 3


def test_preempted_image_rows_recompute_to_the_same_tokens(llava_engine, hf_llava, questions) -> None:
    """A pool of 7 blocks of 16 tokens for three image rows of ~4 blocks each: rows are preempted and recomputed
    (their images' placeholders fed again from the encoder cache), the text unchanged."""
    engine = llava_engine.with_config(EngineConfig(**CPU, num_kv_blocks=7, enable_prefix_caching=False,
                                                   max_num_batched_tokens=24))
    prompts = [{"prompt": q, "images": [picture("RGB", (45, 55), 40 + i)]} for i, q in enumerate(questions[4:7])]
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_token_ids == _hf(hf_llava, prompt)


def _item(offset: int, length: int, mm_hash: str) -> MultiModalItem:
    return MultiModalItem(torch.zeros(3, 2, 2), offset, length, mm_hash)


def test_block_keys_carry_the_mm_hashes_of_their_images() -> None:
    kv = KVCacheManager(16, 4)
    tokens = [1, 2, 9, 9, 9, 9, 9, 3, 4, 5, 6, 7, 8]  # the image's placeholders at 2..6: blocks 0 and 1
    params = SamplingParams(max_tokens=1)
    a = Request("a", tokens, params, mm_items=(_item(2, 5, "aa"),))
    b = Request("b", tokens, params, mm_items=(_item(2, 5, "bb"),))
    a2 = Request("a2", tokens, params, mm_items=(_item(2, 5, "aa"),))
    ha, hb, ha2 = kv.block_hashes(a), kv.block_hashes(b), kv.block_hashes(a2)
    assert ha == ha2
    assert ha[0] != hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # block 2 holds no image, but its chain differs
    text = Request("t", tokens, params)
    assert kv._block_tokens(text, 2) == kv._block_tokens(a, 2) == (4, 5, 6, 7)
    assert kv._block_tokens(a, 1) == (9, 9, 9, 3, "aa")


def test_encoder_cache_keeps_in_use_entries_and_evicts_freed_first() -> None:
    cache = EncoderCache(budget_tokens=6)
    cache.put("x", torch.zeros(3, 2))
    cache.use("x", "r1")
    cache.put("y", torch.zeros(3, 2))  # freed at once: nobody uses it
    cache.put("z", torch.zeros(3, 2))  # over budget: y (freed) goes before x (in use)
    assert "x" in cache and "y" not in cache and "z" in cache and cache.num_tokens == 6
    cache.put("w", torch.zeros(3, 2), keep={"z"})  # nothing freed left: x, in use, goes (re-encoded when needed)
    assert "x" not in cache and "z" in cache and "w" in cache
    cache.use("w", "r2")
    cache.release("w", "r2")
    assert not cache.in_use("w") and cache.get("w") is not None  # freed, still reusable
    cache.use("z", "r3")
    cache.forget_requests(["r3"])
    assert not cache.in_use("z")
