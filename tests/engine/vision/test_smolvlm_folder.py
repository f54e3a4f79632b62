"""A SmolVLM folder as the hub ships it: its processor_config.json names SmolVLMProcessor (which needs num2words, a
tokenmill dependency, and whose video half needs torchvision, which tokenmill does not install) and sets its own
image_seq_len. tokenmill builds that processor without its video half and with the folder's settings, so the prompt
ids and the greedy output equal HF transformers' (the same layout through Idefics3Processor, which loads here) on real
questions and pictures; a folder whose processor the fallback cannot build either keeps AutoProcessor's own error."""

from __future__ import annotations

import json

import pytest
import vlm_cases as cases
from idefics3_models import TOKENS_PER_TILE, build_idefics3
from vlm_cases import CPU

from engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def smolvlm_folder(tmp_path_factory: pytest.TempPathFactory, gguf_path: str):
    """(folder, HF reference) of the tiny SmolVLM whose processor_config.json says what the hub's does."""
    import transformers

    from engine.text.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tiny-smolvlm-hub")
    build_idefics3(folder, Tokenizer.from_gguf(gguf_path).hf_tokenizer, "smolvlm", longest_edge=96)
    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(folder, dtype="float32",
                                                                       attn_implementation="eager").eval()
    reference = transformers.AutoProcessor.from_pretrained(folder)  # Idefics3Processor: the same image layout
    config = folder / "processor_config.json"
    saved = json.loads(config.read_text())
    assert saved["processor_class"] == "Idefics3Processor" and saved["image_seq_len"] == TOKENS_PER_TILE
    config.write_text(json.dumps({**saved, "processor_class": "SmolVLMProcessor"}))
    with pytest.raises(OSError):  # HF's own AutoProcessor cannot load it here (the video half): why the fallback
        transformers.AutoProcessor.from_pretrained(folder)
    return folder, cases.hf_reference(model, reference)


def test_a_smolvlm_processor_folder_runs_with_its_own_image_seq_len(smolvlm_folder, questions) -> None:
    folder, hf = smolvlm_folder
    engine = LLMEngine.from_model(str(folder), EngineConfig(**CPU))
    processor = engine.image_processor.hf
    assert type(processor).__mro__[1].__name__ == "SmolVLMProcessor"
    assert processor.image_seq_len == TOKENS_PER_TILE != 169  # the folder's, not the class default
    cases.assert_greedy_matches(engine, cases.every_mode_prompts(questions), hf)


def test_a_folder_without_a_loadable_processor_names_the_problem(smolvlm_folder, tmp_path) -> None:
    from engine.loading.hf_folder import read_hf_config
    from engine.multimodal.processor import ImageProcessor

    folder, _ = smolvlm_folder
    vision = read_hf_config(str(folder)).vision  # the model's VisionConfig, as LLMEngine.from_model reads it
    broken = tmp_path / "no-processor"
    broken.mkdir()
    (broken / "processor_config.json").write_text(json.dumps({"processor_class": "NoSuchProcessor"}))
    with pytest.raises(ValueError, match="no image processor transformers can load"):
        ImageProcessor.from_model_path(str(broken), vision)
