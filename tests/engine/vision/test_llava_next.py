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
    """(engine, HF reference, HF processor) of the tiny LLaVA-NeXT, the HF side loaded from the folder."""
    import transformers

    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-llava-next")
    build_llava_next(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer)
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        folder, dtype="float32", attn_implementation="eager").eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    engine = LLMEngine.from_model(str(folder), EngineConfig(**CPU))
    return engine, cases.hf_reference(model, processor), processor


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

    engine, _, processor = next_model
    v = engine.model_config.vision
    for h in (1, 7, 20, 28, 33, 56, 61, 90, 200):
        for w in (1, 9, 28, 40, 57, 84, 131):
            want = processor._get_number_of_features(h, w, TILE, TILE) - 1  # "default": no CLS row
            assert anyres_tokens(v, (h, w)) == want, (h, w)


def test_greedy_matches_hf_on_pictures_of_every_size_and_mode(next_model, questions) -> None:
    engine, hf, _ = next_model
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
