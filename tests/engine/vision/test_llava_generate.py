"""LLaVA-1.5 through LLMEngine.generate, greedy token-identical to HF transformers' generate with the model's own
processor on real pictures (drawn with Pillow in several sizes and modes: RGB, RGBA, L, P, a CMYK JPEG; given as PIL
images, PNG/JPEG bytes and data: URLs) and real questions, one or several images per row, every prompt form
(engine.multimodal)."""

from __future__ import annotations

import pytest
import torch
from llava_models import MAX_TOKENS, TOKENS_PER_IMAGE, data_url, encoded, hf_greedy, picture

from engine import SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _chat(images: list, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]


def test_llava_loads_from_the_hf_folder(llava_engine) -> None:
    cfg = llava_engine.model_config
    assert cfg.architecture == "llava" and cfg.vision is not None
    assert cfg.vision.tokens_per_image == TOKENS_PER_IMAGE and cfg.vision.layers_run == 2
    assert llava_engine.image_processor is not None


def test_param_shapes_are_the_built_models(llava_engine) -> None:
    from engine.model.registry import entry_of

    cfg = llava_engine.model_config
    with torch.device("meta"):
        built = {k: tuple(v.shape) for k, v in type(llava_engine.model)(cfg, 8).state_dict().items()}
    assert entry_of(cfg).param_shapes(cfg) == built


def test_greedy_matches_hf_on_pictures_of_every_mode(llava_engine, hf_llava, questions) -> None:
    """One batch: single pictures in each mode and form, and a row with three images (two PIL, one data: URL),
    against HF's generate one prompt at a time."""
    model, processor = hf_llava
    images = [
        picture("RGB", (80, 60), 1),                                   # PIL, wider than tall
        encoded(picture("RGBA", (40, 90), 2), "PNG"),                  # PNG bytes with alpha, taller than wide
        picture("L", (64, 64), 3),                                     # grey PIL
        encoded(picture("CMYK", (100, 70), 4), "JPEG"),                # a CMYK JPEG
        data_url(encoded(picture("P", (57, 33), 5), "PNG")),           # palette PNG as a data: URL
    ]
    prompts = [{"prompt": q, "images": [img]} for q, img in zip(questions, images, strict=False)]
    several = [picture("RGB", (30, 45), 6), picture("RGB", (120, 90), 7), data_url(encoded(images[0], "PNG"))]
    prompts.append({"prompt": questions[5], "images": several})
    outs = llava_engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length", out.error
        ids, want = hf_greedy(model, processor, _chat(prompt["images"], prompt["prompt"]), prompt["images"],
                              MAX_TOKENS)
        assert out.prompt_token_ids == ids
        assert out.output_token_ids == want, prompt["prompt"][:40]
    assert sum(t == llava_engine.model_config.vision.image_token_id for t in outs[-1].prompt_token_ids) == (
        3 * TOKENS_PER_IMAGE)


def test_the_image_changes_the_text(llava_engine, questions) -> None:
    """The tiny model's text depends on its image (so the parity tests see the images)."""
    a, b = llava_engine.generate([{"prompt": questions[0], "images": [picture("RGB", (64, 48), s)]} for s in (8, 9)],
                                 GREEDY)
    assert a.output_token_ids != b.output_token_ids


def test_messages_with_openai_and_hf_image_parts(llava_engine, hf_llava, questions) -> None:
    """Messages with interleaved content parts: an OpenAI image_url part with a data: URL, an image part carrying
    its image, and a bare image part taking the prompt's "images"; also a plain messages list (no dict)."""
    model, processor = hf_llava
    pics = [picture("RGB", (70, 50), 10), picture("RGBA", (50, 70), 11), picture("L", (90, 90), 12)]
    content = [{"type": "text", "text": questions[6]},
               {"type": "image_url", "image_url": {"url": data_url(encoded(pics[0], "PNG"))}},
               {"type": "image", "image": pics[1]},
               {"type": "image"}]
    prompt = {"messages": [{"role": "user", "content": content}], "images": [pics[2]]}
    url = {"url": data_url(encoded(pics[1], "PNG"))}
    plain = [{"role": "user", "content": [{"type": "image_url", "image_url": url},
                                          {"type": "text", "text": questions[7]}]}]
    outs = llava_engine.generate([prompt, plain], GREEDY)
    hf_msgs = [{"role": "user", "content": [{"type": "text", "text": questions[6]}] + [{"type": "image"}] * 3}]
    ids, want = hf_greedy(model, processor, hf_msgs, [encoded(pics[0], "PNG"), pics[1], pics[2]], MAX_TOKENS)
    assert (outs[0].prompt_token_ids, outs[0].output_token_ids) == (ids, want)
    ids, want = hf_greedy(model, processor, _chat([pics[1]], questions[7]), [encoded(pics[1], "PNG")], MAX_TOKENS)
    assert (outs[1].prompt_token_ids, outs[1].output_token_ids) == (ids, want)


def test_raw_prompt_spells_the_image_token(llava_engine, hf_llava, questions) -> None:
    model, processor = hf_llava
    pics = [picture("RGB", (60, 60), 13), picture("RGB", (61, 40), 14)]
    raw = f"USER: <image>\n<image>\n{questions[1]} ASSISTANT:"
    out = llava_engine.generate([{"prompt": raw, "images": pics}], GREEDY, use_chat_template=False)[0]
    ids, want = hf_greedy(model, processor, None, pics, MAX_TOKENS, raw=raw)
    assert (out.prompt_token_ids, out.output_token_ids) == (ids, want)


def test_user_text_spelling_the_image_token_is_text(llava_engine) -> None:
    """A chat message's "<image>" is plain characters (engine.text.tokenizer), not a placeholder: one image, one
    placeholder run."""
    out = llava_engine.generate([{"prompt": "What is <image> here?", "images": [picture("RGB", (50, 50), 15)]}],
                                GREEDY)[0]
    assert out.finish_reason == "length", out.error
    image_id = llava_engine.model_config.vision.image_token_id
    assert sum(t == image_id for t in out.prompt_token_ids) == TOKENS_PER_IMAGE


@pytest.mark.parametrize("layout", ["original", "transformers5"])
def test_every_checkpoint_key_layout_loads(llava_folder, llava_engine, tmp_path, layout: str, questions) -> None:
    """The original llava-hf keys (language_model.model.*, vision_tower.vision_model.*) and transformers 5's
    in-memory ones (model.language_model.*, model.vision_tower.*) load to the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine import EngineConfig, LLMEngine

    folder, _ = llava_folder
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    state = load_file(folder / "model.safetensors")
    if layout == "original":
        renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in state.items()}
    else:
        renamed = {("lm_head.weight" if k == "language_model.lm_head.weight" else
                    "model." + k.replace("language_model.model.", "language_model.", 1)): v for k, v in state.items()}
    save_file(renamed, tmp_path / "model.safetensors")
    engine = LLMEngine.from_model(str(tmp_path), EngineConfig(device="cpu", dtype="float32"))
    prompt = [{"prompt": questions[2], "images": [picture("RGB", (40, 40), 16)]}]
    want = llava_engine.generate(prompt, GREEDY)[0].output_token_ids
    assert engine.generate(prompt, GREEDY)[0].output_token_ids == want
