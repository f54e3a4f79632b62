"""Gemma 3 vision-language through LLMEngine.generate, greedy token-identical to HF transformers' generate with the
model's own Gemma3Processor (each image a run of 16 soft tokens between <start_of_image> and <end_of_image>, in
newlines that join the text around them) on pictures drawn with Pillow in several sizes and modes and real
questions: several images in a row, a raw prompt, the same image in two rows (a prefix-cache hit that ends inside
the image), a chunked prefill (each image kept in one chunk). The soft tokens of one image attend to each other in
prefill, as HF's token_type_ids mask, on sliding layers whose window is shorter than an image: HF's own output with
a causal mask differs on these prompts, so a causal engine fails them. Also the config reader on a released
Gemma 3 config."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import vlm_cases as cases
from gemma3_vl_models import TOKENS_PER_IMAGE, WINDOW, build_gemma3_vl, hf_causal_greedy
from llava_models import MAX_TOKENS, picture
from vlm_cases import CPU, GREEDY

from engine import EngineConfig, LLMEngine
from engine.model.hf_config import config_from_hf
from engine.model.registry import entry_of

#: google/gemma-3-4b-it's config.json, its fields that shape the model (the rest are HF's defaults).
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                    "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "query_pre_attn_scalar": 256, "sliding_window": 1024, "rope_scaling":
                    {"rope_type": "linear", "factor": 8.0}},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                      "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                      "vision_use_head": False}}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    """(engine, HF reference, HF model, HF processor) of the tiny Gemma 3, the HF side loaded from the folder as a
    user would."""
    import transformers

    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-gemma3-vl")
    build_gemma3_vl(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype="float32",
                                                                        attn_implementation="eager").eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    engine = LLMEngine.from_model(str(folder), EngineConfig(**CPU))
    return engine, cases.hf_reference(model, processor), model, processor


def test_loads_from_the_hf_folder_with_its_shapes(gemma3) -> None:
    engine = gemma3[0]
    cfg = engine.model_config
    assert cfg.architecture == "gemma3_vl" and cfg.vision.tokens_per_image == TOKENS_PER_IMAGE
    assert cfg.vision.scale_factor == 2 and engine.model.bidirectional_images  # 8x8 patches pooled to 4x4
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"} and cfg.sliding_window == WINDOW
    with torch.device("meta"):
        built = {k: tuple(v.shape) for k, v in type(engine.model)(cfg, 8).state_dict().items()}
    assert cfg.tie_word_embeddings and entry_of(cfg).param_shapes(cfg) == {
        k: s for k, s in built.items() if k != "lm_head.weight"}


def test_reads_a_released_gemma3_config(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = config_from_hf(copy.deepcopy(GEMMA3_4B))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    v = cfg.vision
    assert (cfg.architecture, v.image_token_id, v.scale_factor, v.tokens_per_image) == ("gemma3_vl", 262144, 4, 256)
    assert (v.hidden_size, v.num_layers, v.image_size, v.hidden_act) == (1152, 27, 896, "gelu_pytorch_tanh")
    assert cfg.sliding_window == 1024 and cfg.rope_local_theta == 10000.0 and cfg.embedding_scale == 2560 ** 0.5
    shapes = entry_of(cfg).param_shapes(cfg)
    assert shapes["multi_modal_projector.mm_input_projection_weight"] == (1152, 2560)
    assert shapes["vision_tower.embeddings.position_embedding.weight"] == (64 * 64, 1152)
    uneven = copy.deepcopy(GEMMA3_4B) | {"mm_tokens_per_image": 100}  # 10 per side does not divide 64 patches
    with pytest.raises(ValueError, match="mm_tokens_per_image 100 must be a square whose side divides") as info:
        config_from_hf(uneven)
    assert "\n" not in str(info.value)


def test_greedy_matches_hf_where_a_causal_mask_would_not(gemma3, questions) -> None:
    engine, hf, model, processor = gemma3
    prompts = cases.every_mode_prompts(questions)
    ids = cases.assert_greedy_matches(engine, prompts, hf)
    token = engine.model_config.vision.image_token_id
    assert [row.count(token) for row in ids] == [TOKENS_PER_IMAGE] * 5 + [3 * TOKENS_PER_IMAGE]
    # the bidirectional mask decides these outputs: HF's own with a causal mask differ (one image, three images)
    for p in (prompts[0], prompts[5]):
        assert hf_causal_greedy(model, processor, p, MAX_TOKENS) != hf(p)[1]


def test_prompt_size_is_the_expansion_without_processing_pixels(gemma3, questions) -> None:
    engine = gemma3[0]
    for prompt in cases.every_mode_prompts(questions):
        ids, items = engine.image_processor.process(prompt, engine.tokenizer)
        n, counts = engine.image_processor.prompt_size(prompt, engine.tokenizer)
        assert (n, counts) == (len(ids), tuple(item.length for item in items))


def test_the_image_changes_the_text(gemma3, questions) -> None:
    cases.assert_image_changes_text(gemma3[0], questions[0])


def test_raw_prompt_spells_the_start_of_image_token(gemma3, questions) -> None:
    """Two <start_of_image> placeholders side by side: their replacements' newlines join into one run."""
    engine, _, model, processor = gemma3
    cases.assert_raw_prompt(engine, model, processor, f"<start_of_image><start_of_image>{questions[1]}")


def test_one_image_in_two_rows_hits_the_prefix_cache_inside_the_image(gemma3, questions) -> None:
    engine, hf = gemma3[:2]
    ids, _ = hf({"prompt": questions[0], "images": [picture("RGB", (80, 60), 21)]})
    first = ids.index(engine.model_config.vision.image_token_id)
    block = engine.block_size
    assert first < block < first + TOKENS_PER_IMAGE  # the shared first block ends inside the image
    cases.assert_one_image_two_rows(engine, hf, questions)


def test_chunked_prefill_keeps_each_image_in_one_chunk(gemma3, questions) -> None:
    """18-token steps: a first chunk of 18 would end inside the first image, so it ends before it (the image runs
    in the next chunk; engine.multimodal.image_attention.image_spans raises on a chunk that ends inside an image);
    each image is encoded once."""
    step = TOKENS_PER_IMAGE + 2
    encoded_images, ids = cases.assert_chunked_prefill(gemma3[0], gemma3[1], questions, step)
    token = gemma3[0].model_config.vision.image_token_id
    first = [row.index(token) for row in ids]
    assert encoded_images == 3 and all(0 < at < step < at + TOKENS_PER_IMAGE for at in first)
    assert all(len(row) > 2 * step for row in ids)


def test_an_image_longer_than_a_step_is_an_error_output(gemma3, questions) -> None:
    engine = gemma3[0].with_config(EngineConfig(**CPU, max_num_batched_tokens=TOKENS_PER_IMAGE - 1))
    out = engine.generate([{"prompt": questions[0], "images": [picture("RGB", (40, 40), 3)]}], GREEDY)[0]
    assert out.finish_reason == "error" and "max_num_batched_tokens >= 16" in out.error
