"""Qwen2.5-VL through LLMEngine.generate, greedy token-identical to HF transformers' generate with the model's own
processor (dynamic resolution: every picture size gives its own number of image tokens) on pictures drawn with Pillow
in several sizes and modes and real questions: one or several images per row, text-only rows beside image rows, the
same image in two rows (prefix-cache hit), a chunked prefill split inside an image, decode after images (M-RoPE's
delta). Also the pieces against HF's own functions: M-RoPE positions (get_rope_index), window order
(get_vision_window_index), the config reader on both config layouts and the checkpoint key layouts."""

from __future__ import annotations

import json

import pytest
import torch
from llava_models import data_url, encoded, hf_greedy, picture
from qwen_vl_models import MERGE, build_qwen_vl

from bench.vision_models import FAMILIES
from engine import EngineConfig, LLMEngine, SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen2_5_vl")
    build_qwen_vl(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer)
    return folder


@pytest.fixture(scope="module")
def hf_qwen(qwen_folder):
    """(HF Qwen2_5_VLForConditionalGeneration fp32 loaded from the folder, the folder's processor)."""
    import transformers

    from engine.multimodal.processor import image_only_processor

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_folder, dtype="float32").eval()
    return model, image_only_processor(str(qwen_folder))


@pytest.fixture(scope="module")
def qwen_engine(qwen_folder):
    return LLMEngine.from_model(str(qwen_folder), EngineConfig(**CPU))


def _chat(n: int, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": text}]}]


def _hf(hf_qwen, prompt: dict) -> tuple[list[int], list[int]]:
    model, processor = hf_qwen
    images = prompt.get("images", [])
    return hf_greedy(model, processor, _chat(len(images), prompt["prompt"]), images, MAX_TOKENS)


def test_loads_with_its_vision_config_and_param_shapes(qwen_engine) -> None:
    from engine.model.registry import entry_of
    from engine.vision_config import QwenVisionConfig

    cfg = qwen_engine.model_config
    assert cfg.architecture == "qwen2_5_vl" and isinstance(cfg.vision, QwenVisionConfig)
    assert cfg.vision.mrope_section == (2, 3, 3) and cfg.vision.fullatt_block_indexes == (1,)
    assert cfg.vision.merger_window == 2 and cfg.qkv_bias
    with torch.device("meta"):
        built = {k: tuple(v.shape) for k, v in type(qwen_engine.model)(cfg, 8).state_dict().items()}
    assert entry_of(cfg).param_shapes(cfg) == built


def test_greedy_matches_hf_on_pictures_of_every_size_and_mode(qwen_engine, hf_qwen, questions) -> None:
    """One batch: pictures of five sizes and modes (each its own image-token count), a row with three images, and
    a text-only row beside them, against HF's generate one prompt at a time."""
    images = [
        picture("RGB", (80, 60), 1),                                   # PIL, wider than tall
        encoded(picture("RGBA", (40, 90), 2), "PNG"),                  # PNG bytes with alpha, taller than wide
        picture("L", (64, 64), 3),                                     # grey PIL
        encoded(picture("CMYK", (100, 70), 4), "JPEG"),                # a CMYK JPEG
        data_url(encoded(picture("P", (130, 33), 5), "PNG")),          # palette PNG as a data: URL, very wide
    ]
    prompts = [{"prompt": q, "images": [img]} for q, img in zip(questions, images, strict=False)]
    prompts.append({"prompt": questions[5], "images": [picture("RGB", (30, 45), 6), picture("RGB", (120, 90), 7),
                                                       images[0]]})
    prompts.append({"prompt": questions[6]})
    prompts.append({"prompt": questions[0], "images": [images[2]]})  # row 0's question, another picture
    outs = qwen_engine.generate(prompts, GREEDY)
    assert outs[-1].output_token_ids != outs[0].output_token_ids  # the picture changes the text
    counts = set()
    image_token = qwen_engine.model_config.vision.image_token_id
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length", out.error
        ids, want = _hf(hf_qwen, prompt)
        assert out.prompt_token_ids == ids
        assert out.output_token_ids == want, prompt["prompt"][:40]
        counts.add(sum(t == image_token for t in ids))
    assert len(counts) >= 5  # dynamic resolution: the sizes give different token counts


def test_same_image_in_two_rows_hits_the_prefix_cache(qwen_engine, hf_qwen, questions) -> None:
    engine = qwen_engine.with_config(EngineConfig(**CPU))
    image = picture("RGB", (72, 56), 21)
    first = {"prompt": questions[0], "images": [image]}
    second = {"prompt": questions[1], "images": [image]}
    out1 = engine.generate([first], GREEDY)[0]
    pool = engine.kv_cache_manager.pool
    hits, encoded_before = pool.num_cache_hits, engine.runner.images.cache.num_encoded
    out2 = engine.generate([second], GREEDY)[0]
    pairs = zip(out1.prompt_token_ids, out2.prompt_token_ids, strict=False)
    common = next(i for i, (a, b) in enumerate(pairs) if a != b)
    assert pool.num_cache_hits - hits == common // engine.kv_cache_manager.block_size > 0
    assert engine.runner.images.cache.num_encoded == encoded_before == 1
    assert out1.output_token_ids == _hf(hf_qwen, first)[1]
    assert out2.output_token_ids == _hf(hf_qwen, second)[1]


def test_chunked_prefill_inside_images_and_decode_after_them(qwen_engine, hf_qwen, questions) -> None:
    """7-token steps (asynchronous scheduling on: the launch path): each image's placeholders span several chunks;
    each image is encoded once and the decode positions continue from the prompt's M-RoPE delta."""
    engine = qwen_engine.with_config(EngineConfig(**CPU, max_num_batched_tokens=7, enable_prefix_caching=False,
                                                  async_scheduling=True))
    prompts = [{"prompt": questions[2], "images": [picture("RGB", (50, 70), 24), picture("L", (70, 50), 25)]},
               {"prompt": questions[3], "images": [picture("RGBA", (66, 66), 26)]}]
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_token_ids == _hf(hf_qwen, prompt)[1]
    assert engine.runner.images.cache.num_encoded == 3


def test_preempted_image_rows_recompute_to_the_same_tokens(qwen_engine, hf_qwen, questions) -> None:
    """A pool of 9 blocks of 16 tokens for three image rows of ~4 blocks each: rows are preempted and recomputed
    (their M-RoPE positions and delta unchanged), the text HF's."""
    engine = qwen_engine.with_config(EngineConfig(**CPU, num_kv_blocks=9, enable_prefix_caching=False,
                                                  max_num_batched_tokens=32))
    prompts = [{"prompt": q, "images": [picture("RGB", (56, 48), 40 + i)]} for i, q in enumerate(questions[4:7])]
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_token_ids == _hf(hf_qwen, prompt)[1]


def test_mrope_positions_are_hf_get_rope_index(hf_qwen) -> None:
    from engine.core.request import Request
    from engine.multimodal.inputs import MultiModalItem
    from engine.multimodal.mrope import prompt_positions, step_rope_rows

    model, _ = hf_qwen
    grids = [(1, 6, 10), (1, 4, 4), (1, 10, 2)]
    pad = model.config.image_token_id
    ids, items = [7, 8, 9], []
    for grid in grids:
        n = grid[0] * grid[1] * grid[2] // MERGE ** 2
        items.append(MultiModalItem(torch.zeros(1), len(ids), n, "h", grid))
        ids += [pad] * n + [5, 6]
    ids += [4, 3, 2, 1]
    types = torch.tensor([[int(t == pad) for t in ids]])
    want, delta = model.model.get_rope_index(torch.tensor([ids]), types, image_grid_thw=torch.tensor(grids))
    got = prompt_positions(len(ids), items, MERGE)
    assert got.tolist() == want[:, 0].tolist()
    req = Request("r", ids, GREEDY, mm_items=tuple(items), mrope_positions=got)
    assert req.mrope_delta == int(delta) < 0
    text = Request("t", [1, 2, 3], GREEDY)
    rows = step_rope_rows([(req, 3), (text, 1)], torch.tensor([len(ids) - 1, len(ids), len(ids) + 1, 2]).numpy())
    assert rows[:, 0].tolist() == want[:, 0, -1].tolist()
    assert rows[:, 1:3].tolist() == [[len(ids) + int(delta), len(ids) + 1 + int(delta)]] * 3
    assert rows[:, 3].tolist() == [2, 2, 2]  # a text-only request: its index in all three
    assert step_rope_rows([(text, 1)], rows[0, 3:]) is None


def test_window_order_is_hf_get_vision_window_index() -> None:
    from transformers.vision_utils import get_vision_window_index

    from engine.model.qwen_vision import window_order

    grids = [(1, 6, 10), (1, 4, 4), (1, 10, 2), (1, 14, 18)]
    index, cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2, window_size=16, patch_size=4)
    orders, bounds, first = [], [0], 0
    for grid in grids:
        order, sizes = window_order(grid, 2, 2)
        orders.append(order + first)
        first += order.numel()
        for s in sizes:
            bounds.append(bounds[-1] + 4 * s)
    assert torch.cat(orders).tolist() == index.tolist()
    assert bounds == cu.tolist()


def _hub_layout(folder) -> dict:
    """The tiny model's config.json rewritten as the hub's Qwen2.5-VL configs are (transformers 4.49): the text
    model's fields at the top level, rope_scaling {"type": "mrope"}, the vision config's old spellings."""
    new = json.loads((folder / "config.json").read_text())
    text = new.pop("text_config")
    rope = text.pop("rope_parameters")
    vision = new.pop("vision_config")
    vision["in_chans"] = vision.pop("in_channels")
    vision.pop("rope_parameters")
    return {**new, **text, "model_type": "qwen2_5_vl", "vision_config": vision, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}


def test_config_reader_reads_both_layouts_and_refuses_what_it_does_not_run(qwen_folder) -> None:
    from engine.model.hf_config import config_from_hf

    new = json.loads((qwen_folder / "config.json").read_text())
    assert config_from_hf(_hub_layout(qwen_folder)) == config_from_hf(new)
    bad = _hub_layout(qwen_folder)
    bad["rope_scaling"] = {"type": "yarn", "factor": 2.0, "mrope_section": [2, 3, 3]}
    with pytest.raises(ValueError, match="yarn"):
        config_from_hf(bad)
    bad = _hub_layout(qwen_folder)
    bad["rope_scaling"]["mrope_section"] = [4, 4, 4]
    with pytest.raises(ValueError, match="mrope_section"):
        config_from_hf(bad)
    bad = _hub_layout(qwen_folder)
    bad["vision_config"]["hidden_act"] = "relu2"
    with pytest.raises(ValueError, match="relu2"):
        config_from_hf(bad)


def test_checkpoint_keys_of_both_layouts_name_the_same_parameters() -> None:
    from engine.loading.hf_folder import _hf_param_name
    from engine.model.architectures import get_architecture

    renames = get_architecture("qwen2_5_vl").hf_renames
    for saved, internal, ours in [
        ("model.layers.0.self_attn.q_proj.bias", "model.language_model.layers.0.self_attn.q_proj.bias",
         "layers.0.self_attn.q_proj.bias"),
        ("visual.blocks.1.attn.qkv.weight", "model.visual.blocks.1.attn.qkv.weight", "visual.blocks.1.attn.qkv.weight"),
        ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight"),
        ("lm_head.weight", "lm_head.weight", "lm_head.weight"),
    ]:
        assert _hf_param_name(saved, renames)[0] == _hf_param_name(internal, renames)[0] == ours


def test_qwen2_vl_greedy_matches_hf(tmp_path, gguf_path: str, questions) -> None:
    """Qwen2-VL (model_type "qwen2_vl": LayerNorm blocks, fc1/fc2 quick-GELU MLP, no windows) through the same
    model file: a batch of a picture, two pictures and text, token-identical to HF."""
    import transformers

    from engine.multimodal.processor import image_only_processor
    from engine.text.tokenizer import Tokenizer

    build_qwen_vl(tmp_path, Tokenizer.from_gguf(gguf_path).hf_tokenizer, family="qwen2_vl")
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(tmp_path, dtype="float32").eval()
    engine = LLMEngine.from_model(str(tmp_path), EngineConfig(**CPU))
    assert engine.model_config.architecture == "qwen2_vl" and engine.model_config.vision.style == "layer"
    prompts = [{"prompt": questions[0], "images": [picture("RGB", (90, 40), 31)]},
               {"prompt": questions[1], "images": [picture("L", (36, 60), 32), picture("RGBA", (70, 70), 33)]},
               {"prompt": questions[2]}]
    outs = engine.generate(prompts, GREEDY)
    processor = image_only_processor(str(tmp_path))  # HF's, built once for the 3 rows
    for prompt, out in zip(prompts, outs, strict=True):
        assert (out.prompt_token_ids, out.output_token_ids) == _hf((hf, processor), prompt)


#: Qwen/Qwen2.5-VL-7B-Instruct's config.json (the hub layout, as it is published; the vision benchmarks' copy).
HUB_7B = FAMILIES["qwen2.5-vl-7b"].config


def test_the_7b_hub_configs_read_to_their_parameter_counts() -> None:
    """Qwen2.5-VL-7B and Qwen2-VL-7B (its vision_config: embed_dim, mlp_ratio, no windows): 8.29B parameters each,
    as their model cards say."""
    from engine.model.hf_config import config_from_hf
    from engine.model.registry import entry_of

    qwen2_vl = HUB_7B | {"model_type": "qwen2_vl", "vision_config": {
        "depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2}}
    for config, window in ((HUB_7B, 4), (qwen2_vl, 0)):
        cfg = config_from_hf(config)
        assert cfg.vision.merger_window == window and cfg.vision.mrope_section == (16, 24, 24)
        shapes = entry_of(cfg).param_shapes(cfg)
        assert round(sum(torch.Size(s).numel() for s in shapes.values()) / 1e9, 2) == 8.29
