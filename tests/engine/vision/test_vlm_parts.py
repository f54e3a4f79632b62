"""The parts of the tiled vision-language families against HF, without a language model: Idefics3's SigLIP encoder on
patch grids smaller than its learned side (bucketed position ids), its pixel shuffle, and the configs tokenmill
refuses (naming the field)."""

from __future__ import annotations

import pytest
import torch

from engine.model.idefics3 import pixel_shuffle
from engine.model.siglip_vision import SiglipVisionTower, bucketed_position_ids
from engine.vision_config import VisionConfig

SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56,
              patch_size=8)


def _vision(**over) -> VisionConfig:
    fields = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, image_size=56, patch_size=8,
                  image_token_id=5, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", feature_layer=-1)
    return VisionConfig(**(fields | over))


@pytest.mark.parametrize("size", [(56, 56), (40, 40), (24, 48), (8, 56)])
def test_siglip_encoder_matches_hf_on_any_patch_grid(size: tuple[int, int]) -> None:
    """A 7x7-position encoder on tiles of 7x7, 5x5, 3x6 and 1x7 patches: HF's bucketed positions, same output."""
    import transformers
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    torch.manual_seed(0)
    cfg = transformers.Idefics3VisionConfig(**SIGLIP)
    cfg._attn_implementation = "eager"
    hf = Idefics3VisionTransformer(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    ours = SiglipVisionTower(_vision())
    ours.load_state_dict(hf.state_dict())
    pixels = torch.randn(3, 3, *size)
    with torch.no_grad():
        want = hf(pixels).last_hidden_state
        got = ours(pixels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bucketed_positions_of_the_full_grid_are_every_position() -> None:
    assert bucketed_position_ids(7, 7, 7, torch.device("cpu")).tolist() == list(range(49))
    assert bucketed_position_ids(2, 3, 4, torch.device("cpu")).tolist() == [0, 1, 2, 8, 9, 10]


def test_pixel_shuffle_is_hf_connectors() -> None:
    import transformers
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    text = {"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1}
    cfg = transformers.Idefics3Config(vision_config=transformers.Idefics3VisionConfig(**SIGLIP), scale_factor=2,
                                      text_config=text)
    x = torch.randn(2, 36, 32)
    torch.testing.assert_close(pixel_shuffle(x, 2), Idefics3Connector(cfg).pixel_shuffle(x, 2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="square grid"):
        pixel_shuffle(torch.randn(1, 35, 4), 2)


def _config(model_type: str, **over) -> dict:
    text = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    vision = {"idefics3": {"model_type": "idefics3_vision", **SIGLIP, "image_size": 64},
              "llava_next": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 28, "patch_size": 7}}
    return {"model_type": model_type, "text_config": text, "vision_config": vision[model_type], "image_token_id": 9,
            **over}


@pytest.mark.parametrize(("model_type", "over", "message"), [
    ("idefics3", {"scale_factor": 3}, "scale_factor 3"),
    ("idefics3", {"vision_config": {"model_type": "clip_vision_model"}}, "vision_config.model_type"),
    ("idefics3", {"image_token_id": 999}, "image_token_id 999"),
    ("llava_next", {"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
    ("llava_next", {"image_grid_pinpoints": [[28, 50]]}, "image_grid_pinpoints"),
])
def test_configs_tokenmill_does_not_run_are_refused(model_type: str, over: dict, message: str) -> None:
    from engine.model.hf_config import config_from_hf

    with pytest.raises(ValueError, match=message):
        config_from_hf(_config(model_type, **over))


def test_configs_read() -> None:
    from engine.model.hf_config import config_from_hf

    cfg = config_from_hf(_config("idefics3") | {"model_type": "smolvlm", "vision_config": {
        "model_type": "smolvlm_vision", **SIGLIP, "image_size": 64}})
    assert cfg.architecture == "idefics3" and cfg.vision.tokens_per_image == 8 * 8 // 2 ** 2
    nxt = config_from_hf(_config("llava_next"))
    assert nxt.architecture == "llava_next" and nxt.vision.image_grid_pinpoints[0] == (336, 672)

