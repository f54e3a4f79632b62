"""Image pixel limits (EngineConfig.max_image_pixels / min_image_pixels) through the model's own HF image processor
(engine.multimodal.pixel_limits): the tiny Qwen2.5-VL with a lower max_pixels gives fewer image tokens and HF's greedy
output with the same processor size, a higher min_pixels enlarges a small picture as HF does; the processor's token
count from the images' sizes (ImageProcessor.prompt_size) is the expansion's; and the limits each family's processor
cannot honour are refused in one line (processors built from their HF classes, no model)."""

from __future__ import annotations

import pytest
from llava_models import MAX_TOKENS, encoded, hf_greedy, picture
from qwen_vl_models import MAX_PIXELS, MERGE, MIN_PIXELS, PATCH, build_qwen_vl

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.multimodal.pixel_limits import pixel_limit_kwargs

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32")
LOWER = 48 * 48  # a quarter of the tiny model's max_pixels (96 x 96)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    """(folder, HF Qwen2_5_VLForConditionalGeneration fp32, its processor without the video half)."""
    import transformers

    from engine.multimodal.processor import image_only_processor
    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen2_5_vl-limits")
    build_qwen_vl(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype="float32").eval()
    return str(folder), model, image_only_processor(str(folder))


@pytest.fixture(scope="module")
def small(qwen) -> LLMEngine:
    """tokenmill's engine over the tiny Qwen2.5-VL with max_image_pixels LOWER."""
    return LLMEngine.from_model(qwen[0], EngineConfig(**CPU, max_image_pixels=LOWER))


def _hf(qwen, prompt: dict, size: dict) -> tuple[list[int], list[int]]:
    _, model, processor = qwen
    chat = [{"role": "user", "content": [{"type": "image"}] * len(prompt["images"])
             + [{"type": "text", "text": prompt["prompt"]}]}]
    return hf_greedy(model, processor, chat, prompt["images"], MAX_TOKENS, size=size)


def _image_tokens(engine: LLMEngine, ids: list[int]) -> int:
    return sum(t == engine.model_config.vision.image_token_id for t in ids)


def test_lower_max_pixels_gives_fewer_image_tokens_and_hf_output(qwen, small, questions) -> None:
    prompts = [{"prompt": questions[0], "images": [picture("RGB", (80, 60), 1)]},
               {"prompt": questions[1], "images": [encoded(picture("RGBA", (40, 90), 2), "PNG"),
                                                   picture("L", (120, 90), 3)]}]
    outs = small.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length", out.error
        ids, want = _hf(qwen, prompt, {"shortest_edge": MIN_PIXELS, "longest_edge": LOWER})
        assert (out.prompt_token_ids, out.output_token_ids) == (ids, want)
        default, _ = _hf(qwen, prompt, {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
        assert _image_tokens(small, ids) < _image_tokens(small, default)
        # each image at most LOWER pixels: (tokens x merged patch area) <= LOWER per image
        assert _image_tokens(small, ids) * (PATCH * MERGE) ** 2 <= LOWER * len(prompt["images"])
        assert small.image_processor.prompt_size(prompt, small.tokenizer)[0] == len(ids)


def test_higher_min_pixels_enlarges_a_small_picture_as_hf_does(qwen, questions) -> None:
    higher = 64 * 64
    engine = LLMEngine.from_model(qwen[0], EngineConfig(**CPU, min_image_pixels=higher))
    prompt = {"prompt": questions[2], "images": [picture("RGB", (20, 24), 4)]}
    out = engine.generate([prompt], GREEDY)[0]
    ids, want = _hf(qwen, prompt, {"shortest_edge": higher, "longest_edge": MAX_PIXELS})
    assert (out.prompt_token_ids, out.output_token_ids) == (ids, want)
    assert _image_tokens(engine, ids) * (PATCH * MERGE) ** 2 >= higher > MIN_PIXELS


def test_prompt_size_is_the_expansion_of_every_picture(small, llava_engine) -> None:
    """The processor's count from the images' sizes (no pixels processed) equals the expanded prompt, for pictures
    of several sizes and forms on Qwen2.5-VL (dynamic resolution) and LLaVA-1.5 (one size)."""
    images = [picture("RGB", (80, 60), 5), encoded(picture("CMYK", (130, 40), 6), "JPEG"), picture("P", (9, 200), 7),
              {"bytes": encoded(picture("RGB", (300, 301), 8), "PNG")}]
    for engine in (small, llava_engine):
        for k in range(len(images)):
            prompt = {"prompt": "What is in the picture?", "images": images[k:k + 2]}
            ids, items = engine.image_processor.process(prompt, engine.tokenizer)
            n, counts = engine.image_processor.prompt_size(prompt, engine.tokenizer)
            assert n == len(ids) and sum(counts) == sum(i.length for i in items)


def test_engine_config_and_with_config_check_the_limits(qwen, small) -> None:
    with pytest.raises(ValueError, match="max_image_pixels must be an integer >= 1"):
        EngineConfig(max_image_pixels=0)
    with pytest.raises(ValueError, match="min_image_pixels 100 is above max_image_pixels 50"):
        EngineConfig(max_image_pixels=50, min_image_pixels=100)
    with pytest.raises(ValueError, match="below the smallest image Qwen2VLImageProcessor makes"):
        LLMEngine.from_model(qwen[0], EngineConfig(**CPU, max_image_pixels=63))
    with pytest.raises(ValueError, match="need the model loaded again"):
        small.with_config(EngineConfig(**CPU))


def _processors() -> dict:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return {
        "qwen": Qwen2VLImageProcessorPil(),  # patch 14, merge 2: 28 x 28 merged patches, 56*56 .. 28*28*1280
        "idefics3": Idefics3ImageProcessorPil(size={"longest_edge": 4 * 364}, max_image_size={"longest_edge": 364}),
        "llava_next": LlavaNextImageProcessorPil(image_grid_pinpoints=[[336, 672], [672, 336], [672, 672]]),
        "clip": CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
    }


@pytest.mark.parametrize(("kind", "max_pixels", "min_pixels", "want"), [
    ("qwen", 1_000_000, None, {"size": {"shortest_edge": 3136, "longest_edge": 1_000_000}}),
    ("qwen", None, 200_000, {"size": {"shortest_edge": 200_000, "longest_edge": 1_003_520}}),
    ("idefics3", 1000 * 1000, None, {"size": {"longest_edge": 728}}),  # 2 tiles of 364 per side
    ("llava_next", 336 * 672, None, {"image_grid_pinpoints": [[336, 672], [672, 336]]}),
    ("llava_next", None, 672 * 672, {"image_grid_pinpoints": [[672, 672]]}),
    ("llava_next", 10**7, None, {}),
    ("clip", 336 * 336, 1, {}),
])
def test_limits_become_the_processors_own_parameters(kind: str, max_pixels, min_pixels, want: dict) -> None:
    assert pixel_limit_kwargs(_processors()[kind], max_pixels, min_pixels) == want


@pytest.mark.parametrize(("kind", "max_pixels", "min_pixels", "said"), [
    ("qwen", 783, None, "--max-pixels 783 is below the smallest image Qwen2VLImageProcessor makes, one merged "
                        "patch of 28x28 = 784 pixels; give at least 784"),
    ("qwen", 1000, None, "--max-pixels 1000 is below the processor's min_pixels 3136: the image processor's pixel "
                         "range would be empty; give --max-pixels >= 3136 or lower --min-pixels"),
    ("qwen", 5000, 6000, "--max-pixels 5000 is below --min-pixels"),
    ("idefics3", 364 * 364 - 1, None, "below one 364x364 tile of Idefics3ImageProcessor (132496 pixels"),
    ("idefics3", None, 1000, "--min-pixels: Idefics3ImageProcessor resizes every image to one longest edge"),
    ("llava_next", 1000, None, "--max-pixels 1000 leave none of LlavaNextImageProcessor's image_grid_pinpoints"),
    ("clip", 336 * 336 - 1, None, "below the one size CLIPImageProcessor makes every image, 336x336 = 112896 "
                                  "pixels (the model takes no smaller); give at least 112896, or drop --max-pixels"),
    ("clip", None, 336 * 336 + 1, "--min-pixels 112897 is above the one size CLIPImageProcessor makes"),
])
def test_limits_a_processor_cannot_honour_are_one_line(kind: str, max_pixels, min_pixels, said: str) -> None:
    names = ("--max-pixels", "--min-pixels")
    with pytest.raises(ValueError) as e:
        pixel_limit_kwargs(_processors()[kind], max_pixels, min_pixels, names=names)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
