"""Idefics3 and SmolVLM through LLMEngine.generate, greedy token-identical to HF transformers' generate with the
model's own processor (its image processor tiles each picture: rows x cols tiles plus the global image, each tile a
run of image tokens after its <fake_token_around_image><row_r_col_c> tags) on pictures drawn with Pillow in several
sizes (so several tilings) and modes, and real questions; several images per row, the same image in two rows (prefix
cache hit, output unchanged), a prefill chunked inside a tile's placeholders (tests/engine/vlm_cases.py)."""

from __future__ import annotations

import pytest
import torch
import vlm_cases as cases
from idefics3_models import TOKENS_PER_TILE, build_idefics3
from llava_models import picture
from vlm_cases import CPU

from engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    """(engine, HF reference, HF model, HF processor) of the tiny Idefics3 (images to 64 pixels: up to 2x2 tiles)
    or SmolVLM (96: up to 3x3), the HF side loaded from the folder as a user would."""
    import transformers

    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    build_idefics3(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer, request.param,
                   longest_edge=64 if request.param == "idefics3" else 96)
    model_class = (transformers.Idefics3ForConditionalGeneration if request.param == "idefics3" else
                   transformers.SmolVLMForConditionalGeneration)
    model = model_class.from_pretrained(folder, dtype="float32", attn_implementation="eager").eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    engine = LLMEngine.from_model(str(folder), EngineConfig(**CPU))
    return engine, cases.hf_reference(model, processor), model, processor, str(folder)


def _tiles(ids: list[int], token: int) -> int:
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
    engine, hf = family[:2]
    ids = cases.assert_greedy_matches(engine, cases.every_mode_prompts(questions), hf)
    token = engine.model_config.vision.image_token_id
    tiles = [_tiles(row, token) for row in ids]
    assert len(set(tiles[:5])) >= 2, tiles  # the sizes tile differently (1x2, 2x1, 2x2, ... plus the global)
    assert tiles[5] > tiles[0] + tiles[3]  # the three images' tiles


def test_the_image_changes_the_text(family, questions) -> None:
    cases.assert_image_changes_text(family[0], questions[0])


def test_raw_prompt_spells_the_image_token(family, questions) -> None:
    engine, _, model, processor, _ = family
    cases.assert_raw_prompt(engine, model, processor, f"User:<image><image>{questions[1]}\nAssistant:")


def test_one_image_in_two_rows_hits_the_prefix_cache(family, questions) -> None:
    cases.assert_one_image_two_rows(family[0], family[1], questions)


def test_chunked_prefill_inside_tiles_encodes_each_once(family, questions) -> None:
    """3-token steps: every tile's 4 placeholders span two chunks; each tile is encoded once."""
    encoded_tiles, ids = cases.assert_chunked_prefill(family[0], family[1], questions, 3)
    assert encoded_tiles == sum(_tiles(row, family[0].model_config.vision.image_token_id) for row in ids)


def test_max_image_pixels_sets_the_longest_edge_as_hf_with_that_size(family, questions) -> None:
    """EngineConfig.max_image_pixels through the processor's own size: one tile's pixels (and a few more: the
    edge stays one tile) make every image the global tile alone; the prompts shorter, greedy output HF's with size
    {"longest_edge": tile}."""
    engine, _, model, processor, folder = family
    tile = processor.image_processor.max_image_size["longest_edge"]
    small = LLMEngine.from_model(folder, EngineConfig(**CPU, max_image_pixels=tile * tile + tile))
    prompts = [{"prompt": questions[k], "images": [picture("RGB", (80, 60), 30 + k)]} for k in range(2)]
    ids = cases.assert_greedy_matches(small, prompts, cases.hf_reference(model, processor, size={"longest_edge": tile}))
    token = engine.model_config.vision.image_token_id
    assert [_tiles(row, token) for row in ids] == [1, 1]
    assert all(len(row) < len(engine.prompt_token_ids(p)) for row, p in zip(ids, prompts, strict=True))
    assert [small.image_processor.prompt_size(p, small.tokenizer)[0] for p in prompts] == [len(row) for row in ids]



def test_a_vision_config_tagged_with_the_top_level_type_reads_as_its_vision_type() -> None:
    """The hub's Idefics3 and SmolVLM (v1) configs tag vision_config "idefics3" (HF's Idefics3Config builds
    Idefics3VisionConfig whatever the tag says): read as "idefics3_vision"; another type is still refused."""
    from engine.model.hf_config import config_from_hf

    text = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 8}

    def read(tag: str):
        return config_from_hf({"model_type": "idefics3", "image_token_id": 7, "scale_factor": 2, "text_config": text,
                               "vision_config": vision | {"model_type": tag}})

    assert read("idefics3").vision == read("idefics3_vision").vision
    with pytest.raises(ValueError, match="vision_config.model_type 'clip_vision_model' is not run"):
        read("clip_vision_model")
