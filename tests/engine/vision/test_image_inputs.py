"""Bad image input: bytes that are not an image and images that do not match their placeholders are error outputs
for their requests while the others go on; a text-only model given images is refused in one line before any work;
the image forms engine.multimodal.inputs decodes and refuses; the LLaVA config reader's refusals."""

from __future__ import annotations

import json

import pytest
from llava_models import MAX_TOKENS, data_url, encoded, picture

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.multimodal.inputs import image_messages, is_image_prompt, load_image

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_bad_images_are_error_outputs_and_the_others_go_on(llava_engine, questions) -> None:
    good = {"prompt": questions[0], "images": [picture("RGB", (40, 40), 31)]}
    prompts = [
        {"prompt": questions[1], "images": [b"\x89PNG\r\n\x1a\nthis is not a picture"]},   # bytes, not an image
        good,
        {"prompt": questions[2], "images": ["data:image/png;base64,@@@"]},               # bad base64
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
         "images": [picture("RGB", (40, 40), 32), picture("RGB", (40, 40), 33)]},       # more images than parts
        # fewer images than the raw text's placeholders (in a chat its "<image>" spellings are text: it runs)
        {"prompt": "USER: <image>\n<image>\nTwo? ASSISTANT:", "images": [picture("L", (40, 40), 34)]},
        {"prompt": questions[3], "images": ["/tmp/picture.png"]},                        # a path: the pipeline's
    ]
    outs = llava_engine.generate(prompts, GREEDY, use_chat_template=True)
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "error", "length", "error"]
    assert "not an image Pillow can read" in outs[0].error
    assert "base64" in outs[2].error
    assert "image parts take 1" in outs[3].error
    assert "path or URL" in outs[5].error
    raw = llava_engine.generate([prompts[4]], GREEDY, use_chat_template=False)[0]
    assert raw.finish_reason == "error" and "2 image placeholders" in raw.error and "but 1 images" in raw.error
    assert outs[1].output_token_ids == llava_engine.generate([good], GREEDY)[0].output_token_ids


def test_a_text_only_model_given_images_is_refused_in_one_line() -> None:
    engine = LLMEngine.from_config("tiny", EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))
    with pytest.raises(ValueError, match="text-only") as e:
        engine.generate([[1, 2, 3], {"prompt": "What is this?", "images": [b"..."]}], GREEDY)
    assert "\n" not in str(e.value) and "prompt 1" in str(e.value)


def test_image_forms() -> None:
    img = picture("CMYK", (30, 20), 35)
    jpeg = encoded(img, "JPEG")
    assert load_image(jpeg).mode == "CMYK" and load_image(jpeg).size == (30, 20)
    assert load_image({"bytes": jpeg, "path": None}).size == (30, 20)  # HF datasets' Image feature
    assert load_image(data_url(jpeg, "image/jpeg")).size == (30, 20)
    assert load_image(img) is img
    for bad, why in ((b"", "not an image"), ("data:image/png,abc", "not base64"), ("s3://b/k.png", "path or URL"),
                     (42, "not int")):
        with pytest.raises(ValueError, match=why):
            load_image(bad)
    assert is_image_prompt({"prompt": "x", "images": []})
    assert not is_image_prompt([{"role": "user", "content": "text"}]) and not is_image_prompt("text")
    with pytest.raises(ValueError, match="'prompt': text"):
        image_messages({"prompt": "x", "messages": [], "images": []})
    with pytest.raises(ValueError, match="more image parts"):
        image_messages({"messages": [{"role": "user", "content": [{"type": "image"}]}], "images": []})


def test_llava_config_refusals(llava_folder, tmp_path) -> None:
    from engine.model.hf_config import config_from_hf

    config = json.loads((llava_folder[0] / "config.json").read_text())
    assert config_from_hf(config).vision.feature_layer == -2
    for change, why in (({"vision_feature_layer": [-2, -1]}, "one feature layer"),
                        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
                        ({"projector_hidden_act": "relu"}, "projector_hidden_act"),
                        ({"vision_config": {**config["vision_config"], "model_type": "siglip_vision_model"}},
                         "vision_config.model_type"),
                        ({"text_config": {**config["text_config"], "model_type": "gemma2"}}, "text_config.model_type"),
                        ({"image_token_index": 10**6}, "outside the text model's vocabulary")):
        with pytest.raises(ValueError, match=why):
            config_from_hf({**config, **change})


def test_the_llava_1_5_7b_config_reads_as_its_shape() -> None:
    """llava-hf/llava-1.5-7b-hf's config.json as published (sparse nested configs: LlamaConfig's and
    CLIPVisionConfig's defaults fill them, as LlavaConfig does): Vicuna-7B plus CLIP ViT-L/14-336, 7.06B params."""
    import math

    from engine.model.hf_config import config_from_hf
    from engine.model.registry import entry_of

    config = {"architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
              "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
              "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                              "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                              "torch_dtype": "float16", "vocab_size": 32064},
              "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
              "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                                "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                                "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
              "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    cfg = config_from_hf(config)
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.max_position_embeddings) == (4096, 32, 32064, 4096)
    assert (cfg.vision.tokens_per_image, cfg.vision.layers_run, cfg.vision.hidden_act) == (576, 23, "quick_gelu")
    params = sum(math.prod(s) for s in entry_of(cfg).param_shapes(cfg).values())
    assert 7.06e9 < params < 7.07e9


def test_quantized_loads_of_a_vision_model_are_refused(llava_folder) -> None:
    with pytest.raises(ValueError, match="quantization int4 is not implemented"):
        LLMEngine.from_model(str(llava_folder[0]), EngineConfig(device="cpu", dtype="float32", quantization="int4"))
