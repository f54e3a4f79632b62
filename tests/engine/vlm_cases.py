"""The cases every vision-language family's tests run against HF (tests/engine/vision/test_idefics3.py,
test_llava_next.py, test_gemma3_vl.py): pictures of several sizes (so several tilings) and modes in every image form
plus a row of three images, one image asked in two rows (a prefix-cache hit, the output unchanged), a prefill chunked
inside images, a raw prompt spelling the placeholders, and two pictures changing the text. `hf(prompt)` is the
family's reference: (prompt ids, greedy output ids) of HF's generate with the model's own processor."""

from __future__ import annotations

from collections.abc import Callable

from llava_models import MAX_TOKENS, data_url, encoded, hf_greedy, picture

from engine import EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32")
Reference = Callable[[dict], tuple[list[int], list[int]]]


def hf_reference(model, processor, **processor_kwargs) -> Reference:
    """The reference of `{"prompt": text, "images": [...]}` prompts: one user turn, the images first (the processor
    called with `processor_kwargs`)."""

    def run(prompt: dict) -> tuple[list[int], list[int]]:
        chat = [{"role": "user", "content": [{"type": "image"}] * len(prompt["images"]) +
                 [{"type": "text", "text": prompt["prompt"]}]}]
        return hf_greedy(model, processor, chat, prompt["images"], MAX_TOKENS, **processor_kwargs)

    return run


def every_mode_prompts(questions: list[str]) -> list[dict]:
    """Five one-image prompts (wide PIL RGB, tall RGBA PNG bytes, a small grey square, a wide CMYK JPEG, a palette PNG
    as a data: URL) and a row of three images."""
    images = [picture("RGB", (80, 60), 1), encoded(picture("RGBA", (40, 90), 2), "PNG"), picture("L", (20, 20), 3),
              encoded(picture("CMYK", (130, 40), 4), "JPEG"), data_url(encoded(picture("P", (57, 33), 5), "PNG"))]
    prompts = [{"prompt": q, "images": [img]} for q, img in zip(questions, images, strict=False)]
    return [*prompts, {"prompt": questions[5], "images": [picture("RGB", (30, 45), 6), images[3], images[0]]}]


def assert_greedy_matches(engine, prompts: list[dict], hf: Reference) -> list[list[int]]:
    """Run `prompts` as one batch; each prompt's ids and greedy output equal HF's. Returns the prompts' ids."""
    outs = engine.generate(prompts, GREEDY)
    ids_of = []
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length", out.error
        ids, want = hf(prompt)
        assert out.prompt_token_ids == ids
        assert out.output_token_ids == want, prompt["prompt"][:40]
        ids_of.append(ids)
    return ids_of


def assert_one_image_two_rows(engine, hf: Reference, questions: list[str]) -> None:
    """The same image asked two questions one after the other: the second reuses the first's prefix-cache blocks
    and encoder cache entries (nothing encoded again), both outputs HF's."""
    engine = engine.with_config(EngineConfig(**CPU))
    image = picture("RGB", (80, 60), 21)
    prompts = [{"prompt": q, "images": [image]} for q in questions[:2]]
    first = engine.generate(prompts[:1], GREEDY)[0]
    pool, cache = engine.kv_cache_manager.pool, engine.runner.images.cache
    hits, encoded_items = pool.num_cache_hits, cache.num_encoded
    second = engine.generate(prompts[1:], GREEDY)[0]
    assert pool.num_cache_hits > hits and cache.num_encoded == encoded_items
    assert [first.output_token_ids, second.output_token_ids] == [hf(p)[1] for p in prompts]


def assert_chunked_prefill(engine, hf: Reference, questions: list[str], step_tokens: int) -> tuple[int, list]:
    """`step_tokens`-token steps, no prefix cache: images' placeholders span chunks; outputs HF's. Returns (the
    encoder cache's num_encoded: items encoded, the prompts' token ids)."""
    engine = engine.with_config(EngineConfig(**CPU, max_num_batched_tokens=step_tokens, enable_prefix_caching=False))
    prompts = [{"prompt": questions[2], "images": [picture("RGB", (50, 70), 24), picture("L", (70, 50), 25)]},
               {"prompt": questions[3], "images": [picture("RGBA", (66, 66), 26)]}]
    outs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == [hf(p)[1] for p in prompts]
    return engine.runner.images.cache.num_encoded, [o.prompt_token_ids for o in outs]


def assert_image_changes_text(engine, question: str) -> None:
    """One question about two pictures: two texts (the tiny model's output depends on its image, so the parity tests
    see the images)."""
    a, b = engine.generate([{"prompt": question, "images": [picture("RGB", (64, 48), s)]} for s in (8, 9)], GREEDY)
    assert a.output_token_ids != b.output_token_ids


def assert_raw_prompt(engine, model, processor, raw: str) -> None:
    """A raw prompt (use_chat_template False) spelling the image placeholder twice, with two pictures: its token ids
    and greedy output HF's (the processor on the same text)."""
    pics = [picture("RGB", (60, 60), 13), picture("RGB", (61, 40), 14)]
    out = engine.generate([{"prompt": raw, "images": pics}], GREEDY, use_chat_template=False)[0]
    assert out.finish_reason == "length", out.error
    assert (out.prompt_token_ids, out.output_token_ids) == hf_greedy(model, processor, None, pics, MAX_TOKENS,
                                                                     raw=raw)
