"""Qwen3-VL through LLMEngine.generate, greedy token-identical to HF transformers' generate with the model's own
processor (Qwen3VLProcessor over the Pillow Qwen2-VL image processor) on the shared cases of tests/engine/vlm_cases.py:
pictures of several sizes and modes (each its own token count, so the learned position grid is resampled up and
down), a row of three images beside a text-only row, one image in two rows (a prefix-cache hit), a prefill chunked
inside images. DeepStack is shown to matter: HF's own text changes when its DeepStack mergers are zeroed, so the
matches above hold only with the features reaching the decoder layers. Also the pieces against HF's own code:
interleaved M-RoPE (Qwen3VLTextRotaryEmbedding), M-RoPE positions (get_rope_index), the config reader on the hub
layout, and parameter names and shapes against HF's default Qwen3VLConfig."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import vlm_cases as cases
from llava_models import MAX_TOKENS, hf_greedy, picture
from qwen_vl_models import MERGE, build_qwen_vl
from vlm_cases import CPU, GREEDY

from engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    """(engine, HF reference, HF model, HF processor, folder) of the tiny Qwen3-VL, the HF side loaded from the folder
    as a user would."""
    import transformers

    from engine.multimodal.processor import image_only_processor
    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-qwen3_vl")
    build_qwen_vl(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer, family="qwen3_vl")
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype="float32").eval()
    processor = image_only_processor(str(folder))
    engine = LLMEngine.from_model(str(folder), EngineConfig(**CPU))
    return engine, cases.hf_reference(model, processor), model, processor, folder


def test_loads_with_its_vision_config_and_param_shapes(qwen3) -> None:
    import dataclasses

    from engine.config import ModelConfig
    from engine.model.registry import entry_of
    from engine.vision_config import Qwen3VisionConfig

    cfg = qwen3[0].model_config
    assert cfg.architecture == "qwen3_vl" and isinstance(cfg.vision, Qwen3VisionConfig)
    assert ModelConfig.from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg  # the weights cache's JSON
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.vision.mrope_section == (4, 2, 2)
    assert cfg.vision.deepstack_visual_indexes == (0, 2) and cfg.vision.position_grid_side == 10
    with torch.device("meta"):
        built = {k: tuple(v.shape) for k, v in type(qwen3[0].model)(cfg, 8).state_dict().items()}
    assert entry_of(cfg).param_shapes(cfg) == built


def test_greedy_matches_hf_on_pictures_of_every_size_and_mode(qwen3, questions) -> None:
    engine, hf = qwen3[:2]
    prompts = [*cases.every_mode_prompts(questions), {"prompt": questions[6], "images": []}]
    ids = cases.assert_greedy_matches(engine, prompts, hf)
    token = engine.model_config.vision.image_token_id
    counts = [sum(t == token for t in row) for row in ids]
    assert len(set(counts[:5])) >= 4 and counts[-1] == 0, counts  # dynamic resolution: sizes give their own counts


def test_deepstack_changes_hfs_text(qwen3, questions) -> None:
    """HF with its DeepStack mergers' outputs zeroed writes other text for the every-mode pictures: the matches of
    the other tests need the DeepStack features added in the decoder layers."""
    model, processor = qwen3[2:4]
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for merger in plain.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
    prompts = cases.every_mode_prompts(questions)[:3]
    without = cases.hf_reference(plain, processor)
    assert all(qwen3[1](p)[1] != without(p)[1] for p in prompts)


def test_one_image_in_two_rows_hits_the_prefix_cache(qwen3, questions) -> None:
    cases.assert_one_image_two_rows(qwen3[0], qwen3[1], questions)


def test_chunked_prefill_inside_images_encodes_each_once(qwen3, questions) -> None:
    """7-token steps: each image's placeholders (and DeepStack rows) span several chunks; each image is encoded
    once."""
    encoded, _ = cases.assert_chunked_prefill(qwen3[0], qwen3[1], questions, 7)
    assert encoded == 3


def test_raw_prompt_spells_the_image_token(qwen3, questions) -> None:
    engine, _, model, processor, _ = qwen3
    pic = picture("RGB", (60, 44), 13)
    raw = f"User: <|image_pad|>{questions[1]}\nAssistant:"  # the placeholder alone: no control tokens spelt
    out = engine.generate([{"prompt": raw, "images": [pic]}], GREEDY, use_chat_template=False)[0]
    assert out.finish_reason == "length", out.error
    assert (out.prompt_token_ids, out.output_token_ids) == hf_greedy(model, processor, None, [pic], MAX_TOKENS,
                                                                     raw=raw)


def test_interleaved_mrope_is_hf_recomposition(qwen3) -> None:
    """Our model's cos/sin of three different positions per token equal HF's Qwen3VLTextRotaryEmbedding's (the real
    sections [24, 20, 20] over head_dim 128 too, through the column axes)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from engine.model.qwen3_vl import interleaved_mrope_axes

    engine, model = qwen3[0], qwen3[2]
    rows = torch.tensor([[0, 5, 9, 40], [0, 7, 3, 41], [0, 2, 11, 45]])
    cos, sin = engine.model.layer_ropes(rows, torch.float32)[0]
    hf = Qwen3VLTextRotaryEmbedding(model.config.text_config)
    want_cos, want_sin = hf(torch.zeros(1, dtype=torch.float32), rows[:, None, :])
    torch.testing.assert_close((cos, sin), (want_cos[0], want_sin[0]))
    big = copy.deepcopy(model.config.text_config)
    big.head_dim, big.rope_parameters = 128, {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]}
    want_cos = Qwen3VLTextRotaryEmbedding(big)(torch.zeros(1), rows[:, None, :])[0][0]
    axes = torch.tensor(interleaved_mrope_axes((24, 20, 20), 128))
    inv = 1.0 / 5e6 ** (torch.arange(0, 128, 2).float() / 128)
    angle = rows.t()[:, axes].float() * torch.cat([inv, inv])
    torch.testing.assert_close(angle.cos(), want_cos)


def test_mrope_positions_are_hf_get_rope_index(qwen3) -> None:
    from engine.multimodal.inputs import MultiModalItem
    from engine.multimodal.mrope import prompt_positions

    model = qwen3[2]
    pad = model.config.image_token_id
    ids, items = [7, 8, 9], []
    for grid in [(1, 6, 10), (1, 4, 4), (1, 10, 2)]:
        n = grid[0] * grid[1] * grid[2] // MERGE ** 2
        items.append(MultiModalItem(torch.zeros(1), len(ids), n, "h", grid))
        ids += [pad] * n + [5, 6]
    types = torch.tensor([[int(t == pad) for t in ids]])
    want, _ = model.model.get_rope_index(torch.tensor([ids]), types,
                                         image_grid_thw=torch.tensor([it.grid_thw for it in items]))
    assert prompt_positions(len(ids), items, MERGE).tolist() == want[:, 0].tolist()


def test_config_reader_reads_the_hub_layout_and_refuses_what_it_does_not_run(qwen3) -> None:
    """The hub's Qwen3-VL configs (transformers 4.57: text_config's rope_scaling and rope_theta) read as the saved
    one; DeepStack deeper than the text model, or a table that is no square grid, is refused."""
    from engine.model.hf_config import config_from_hf

    new = json.loads((qwen3[4] / "config.json").read_text())
    hub = copy.deepcopy(new)
    rope = hub["text_config"].pop("rope_parameters")
    hub["text_config"] |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    assert config_from_hf(hub) == config_from_hf(new)
    bad = copy.deepcopy(new)
    bad["vision_config"]["deepstack_visual_indexes"] = [0, 1, 2]
    bad["text_config"]["num_hidden_layers"] = 2
    with pytest.raises(ValueError, match="deepstack"):
        config_from_hf(bad)
    bad = copy.deepcopy(new)
    bad["vision_config"]["num_position_embeddings"] = 99
    with pytest.raises(ValueError, match="square"):
        config_from_hf(bad)


def test_hf_default_config_reads_to_hfs_parameter_names_and_shapes() -> None:
    """HF's default Qwen3VLConfig (27 vision blocks, DeepStack from 8, 16, 24; a 32-layer text model; its merger's
    width set to the text model's, which the default leaves at 3584 against 4096), built on the meta device: its
    checkpoint keys, through our renames, are our parameters with the same shapes."""
    import transformers

    from engine.loading.hf_folder import _hf_param_name
    from engine.model.architectures import get_architecture
    from engine.model.hf_config import config_from_hf
    from engine.model.registry import entry_of

    hf_config = transformers.Qwen3VLConfig(vision_config={"out_hidden_size": 4096})
    with torch.device("meta"):
        hf = transformers.Qwen3VLForConditionalGeneration(hf_config)
    renames = get_architecture("qwen3_vl").hf_renames
    want = {_hf_param_name(k, renames)[0]: tuple(v.shape) for k, v in hf.state_dict().items()}
    cfg = config_from_hf(hf_config.to_dict())
    assert cfg.vision.deepstack_visual_indexes == (8, 16, 24) and cfg.rope_theta == 500000.0
    assert entry_of(cfg).param_shapes(cfg) == want
