"""Idefics3 and SmolVLM through LLMEngine.generate, greedy token-identical to HF transformers' generate with the
model's own processor (its image processor tiles each picture: rows x cols tiles plus the global image, each tile a
run of image tokens after its <fake_token_around_image><row_r_col_c> tags) on pictures drawn with Pillow in several
sizes (so several tilings) and modes, and real questions; several images per row, the same image in two rows (prefix
cache hit, output unchanged), a prefill chunked inside a tile's placeholders."""

from __future__ import annotations

import pytest
import torch
from idefics3_models import TOKENS_PER_TILE, build_idefics3
from llava_models import MAX_TOKENS, data_url, encoded, hf_greedy, picture

from engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32")


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    """(engine, HF model, HF processor) of the tiny Idefics3 (images to 64 pixels: up to 2x2 tiles) or SmolVLM (96:
    up to 3x3), the HF side loaded from the folder as a user would."""
    import transformers

    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_idefics3(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer, request.param,
                   longest_edge=64 if request.param == "idefics3" else 96)
    model_class = (transformers.Idefics3ForConditionalGeneration if request.param == "idefics3" else
                   transformers.SmolVLMForConditionalGeneration)
    model = model_class.from_pretrained(folder, dtype="float32", attn_implementation="eager").eval()
    engine = LLMEngine.from_model(str(folder), EngineConfig(**CPU))
    return engine, model, transformers.AutoProcessor.from_pretrained(folder)


def _chat(images: list, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]


def _hf(family, prompt: dict) -> tuple[list[int], list[int]]:
    _, model, processor = family
    return hf_greedy(model, processor, _chat(prompt["images"], prompt["prompt"]), prompt["images"], MAX_TOKENS)


def _runs(ids: list[int], token: int) -> int:
    """Runs of image tokens in `ids` (= tiles)."""
    return sum(t == token and (i == 0 or ids[i - 1] != token) for i, t in enumerate(ids))


def test_loads_from_the_hf_folder_with_its_shapes(family) -> None:
    from engine.model.registry import entry_of

    engine = family[0]
    cfg = engine.model_config
    assert cfg.architecture == "idefics3" and cfg.vision.tokens_per_image == TOKENS_PER_TILE
    assert cfg.vision.scale_factor == 2 and cfg.vision.layers_run == 2
    with torch.device("meta"):
        built = {k: tuple(v.shape) for k, v in type(engine.model)(cfg, 8).state_dict().items()}
    assert entry_of(cfg).param_shapes(cfg) == built


def test_greedy_matches_hf_on_pictures_of_every_size_and_mode(family, questions) -> None:
    """One batch: pictures wide, tall, square and small (so the tilings differ), in each mode and form, and a row
    with three images, against HF's generate one prompt at a time."""
    engine = family[0]
    images = [
        picture("RGB", (80, 60), 1),                                   # PIL, wider than tall
        encoded(picture("RGBA", (40, 90), 2), "PNG"),                  # PNG bytes with alpha, tall
        picture("L", (20, 20), 3),                                     # small grey square
        encoded(picture("CMYK", (130, 40), 4), "JPEG"),                # a wide CMYK JPEG
        data_url(encoded(picture("P", (57, 33), 5), "PNG")),           # palette PNG as a data: URL
    ]
    prompts = [{"prompt": q, "images": [img]} for q, img in zip(questions, images, strict=False)]
    prompts.append({"prompt": questions[5], "images": [picture("RGB", (30, 45), 6), images[3], images[0]]})
    outs = engine.generate(prompts, GREEDY)
    token = engine.model_config.vision.image_token_id
    tiles = []
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length", out.error
        ids, want = _hf(family, prompt)
        assert out.prompt_token_ids == ids
        assert out.output_token_ids == want, prompt["prompt"][:40]
        tiles.append(_runs(ids, token))
    assert len(set(tiles[:5])) >= 2, tiles  # the sizes tile differently (1x2, 2x1, 2x2, ... plus the global)
    assert tiles[5] > tiles[0] + tiles[3]  # the three images' tiles


def test_the_image_changes_the_text(family, questions) -> None:
    a, b = family[0].generate([{"prompt": questions[0], "images": [picture("RGB", (64, 48), s)]} for s in (8, 9)],
                              GREEDY)
    assert a.output_token_ids != b.output_token_ids


def test_raw_prompt_spells_the_image_token(family, questions) -> None:
    engine = family[0]
    _, model, processor = family
    pics = [picture("RGB", (60, 60), 13), picture("RGB", (61, 40), 14)]
    raw = f"User:<image><image>{questions[1]}\nAssistant:"
    out = engine.generate([{"prompt": raw, "images": pics}], GREEDY, use_chat_template=False)[0]
    assert out.finish_reason == "length", out.error
    ids, want = hf_greedy(model, processor, None, pics, MAX_TOKENS, raw=raw)
    assert (out.prompt_token_ids, out.output_token_ids) == (ids, want)


def test_one_image_in_two_rows_hits_the_prefix_cache(family, questions) -> None:
    engine = family[0].with_config(EngineConfig(**CPU))
    image = picture("RGB", (80, 60), 21)
    first = engine.generate([{"prompt": questions[0], "images": [image]}], GREEDY)[0]
    pool, cache = engine.kv_cache_manager.pool, engine.runner.images.cache
    hits, encoded_tiles = pool.num_cache_hits, cache.num_encoded
    second = {"prompt": questions[1], "images": [image]}
    out = engine.generate([second], GREEDY)[0]
    assert pool.num_cache_hits > hits  # the blocks of the shared prefix (the image's tiles) are reused
    assert cache.num_encoded == encoded_tiles  # no tile encoded again
    assert first.output_token_ids == _hf(family, {"prompt": questions[0], "images": [image]})[1]
    assert out.output_token_ids == _hf(family, second)[1]


def test_chunked_prefill_inside_tiles_encodes_each_once(family, questions) -> None:
    """3-token steps: every tile's 4 placeholders span two chunks; each tile is encoded once."""
    engine = family[0].with_config(EngineConfig(**CPU, max_num_batched_tokens=3, enable_prefix_caching=False))
    prompts = [{"prompt": questions[2], "images": [picture("RGB", (50, 70), 24), picture("L", (70, 50), 25)]},
               {"prompt": questions[3], "images": [picture("RGBA", (66, 66), 26)]}]
    outs = engine.generate(prompts, GREEDY)
    token = engine.model_config.vision.image_token_id
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_token_ids == _hf(family, prompt)[1]
    assert engine.runner.images.cache.num_encoded == sum(_runs(o.prompt_token_ids, token) for o in outs)
