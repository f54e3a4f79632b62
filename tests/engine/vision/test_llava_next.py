"""LLaVA-NeXT through LLMEngine.generate, greedy token-identical to HF transformers' generate with the model's own
LlavaNextProcessor (anyres: the image resized into the best grid pinpoint, tiled, plus a base tile; its features
unpadded and ended row by row by image_newline) on pictures drawn with Pillow in several sizes (so several grids and
unpaddings) and modes, and real questions; several images per row, the same image in two rows (prefix cache hit,
output unchanged), a prefill chunked inside an image's placeholders (tests/engine/vlm_cases.py)."""

from __future__ import annotations

import pytest
import torch
import vlm_cases as cases
from llava_models import picture
from llava_next_models import BASE_TOKENS, PINPOINTS, TILE, build_llava_next
from vlm_cases import CPU, GREEDY

from engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def next_model(tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    """(engine, HF reference, HF processor, HF model, folder) of the tiny LLaVA-NeXT, the HF side loaded from the
    folder."""
    import transformers

    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-llava-next")
    build_llava_next(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer)
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        folder, dtype="float32", attn_implementation="eager").eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    engine = LLMEngine.from_model(str(folder), EngineConfig(**CPU))
    return engine, cases.hf_reference(model, processor), processor, model, str(folder)


def test_loads_from_the_hf_folder_with_its_shapes(next_model) -> None:
    from engine.model.registry import entry_of

    engine = next_model[0]
    cfg = engine.model_config
    assert cfg.architecture == "llava_next" and cfg.vision.tokens_per_image == BASE_TOKENS
    assert cfg.vision.image_grid_pinpoints == tuple(map(tuple, PINPOINTS))
    with torch.device("meta"):
        built = {k: tuple(v.shape) for k, v in type(engine.model)(cfg, 8).state_dict().items()}
    assert entry_of(cfg).param_shapes(cfg) == built


def test_anyres_token_counts_are_the_processors(next_model) -> None:
    """engine.multimodal.anyres counts what LlavaNextProcessor writes, over sizes of every aspect."""
    from engine.multimodal.anyres import anyres_tokens

    engine, _, processor = next_model[:3]
    v = engine.model_config.vision
    for h in (1, 7, 20, 28, 33, 56, 61, 90, 200):
        for w in (1, 9, 28, 40, 57, 84, 131):
            want = processor._get_number_of_features(h, w, TILE, TILE) - 1  # "default": no CLS row
            assert anyres_tokens(v, (h, w)) == want, (h, w)


def test_greedy_matches_hf_on_pictures_of_every_size_and_mode(next_model, questions) -> None:
    engine, hf = next_model[:2]
    ids = cases.assert_greedy_matches(engine, cases.every_mode_prompts(questions), hf)
    token = engine.model_config.vision.image_token_id
    counts = [sum(t == token for t in row) for row in ids]
    assert len(set(counts[:5])) >= 4, counts  # the sizes give different grids and unpaddings


def test_the_image_changes_the_text(next_model, questions) -> None:
    a, b = next_model[0].generate([{"prompt": questions[0], "images": [picture("RGB", (64, 48), s)]} for s in (8, 9)],
                                  GREEDY)
    assert a.output_token_ids != b.output_token_ids


def test_one_image_in_two_rows_hits_the_prefix_cache(next_model, questions) -> None:
    cases.assert_one_image_two_rows(next_model[0], next_model[1], questions)


def test_chunked_prefill_inside_an_image_encodes_it_once(next_model, questions) -> None:
    """7-token steps: every image's placeholders span many chunks; each image is encoded once."""
    assert cases.assert_chunked_prefill(next_model[0], next_model[1], questions, 7)[0] == 3


def test_pixel_limits_keep_the_pinpoints_within_them_as_hf_with_those(next_model, questions) -> None:
    """max_image_pixels 56 x 28 keeps the 1x2 and 2x1 tile pinpoints: the model and the processor both take those
    (as HF's model with config.image_grid_pinpoints and processor with image_grid_pinpoints set to them), so a square
    picture is no longer resized into 2x2 tiles; greedy output HF's."""
    import transformers

    engine, _, _, model, folder = next_model
    kept = [p for p in PINPOINTS if p[0] * p[1] <= 56 * 28]
    small = LLMEngine.from_model(folder, EngineConfig(**CPU, max_image_pixels=56 * 28))
    assert small.model_config.vision.image_grid_pinpoints == tuple(map(tuple, kept)) != tuple(map(tuple, PINPOINTS))
    processor = transformers.AutoProcessor.from_pretrained(folder, image_grid_pinpoints=kept)
    prompts = [{"prompt": questions[k], "images": [picture("RGB", (60, 60), 40 + k)]} for k in range(2)]
    model.config.image_grid_pinpoints = kept
    try:
        ids = cases.assert_greedy_matches(small, prompts, cases.hf_reference(model, processor))
    finally:
        model.config.image_grid_pinpoints = PINPOINTS
    assert all(len(row) < len(engine.prompt_token_ids(p)) for row, p in zip(ids, prompts, strict=True))
    assert [small.image_processor.prompt_size(p, small.tokenizer)[0] for p in prompts] == [len(row) for row in ids]

