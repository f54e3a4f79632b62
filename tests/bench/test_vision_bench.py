"""The vision benchmarks checked without a GPU and without timing anything: the released LLaVA-1.5-7B, Qwen2.5-VL-7B,
Gemma-3-4B, Qwen3-VL-8B and SmolVLM-256M shapes of bench/vision_models.py build on the meta device with their real
parameter counts (HF's classes from the inline configs; tokenmill's model where its registry runs the family), the GPU
preset (bench/vision_gpu.py) runs end to end at its tiny shape on the CPU, and so does the CPU side by side
(bench/vision.py: tokenmill and HF transformers on one saved folder; vLLM left out). bench/gpu_session.sh's `vision`
step's arguments are checked by tests/bench/test_gpu_session.py."""

from __future__ import annotations

import pytest
import torch

from bench import vision, vision_gpu
from bench.embed_gpu import tokenizer_folder
from bench.vision_models import FAMILIES, family, family_missing, picture, questions, shaped_config, with_tokenizer

#: Released parameter counts (HF's model classes on the released configs: llava-hf/llava-1.5-7b-hf,
#: Qwen/Qwen2.5-VL-7B-Instruct, google/gemma-3-4b-it, Qwen/Qwen3-VL-8B-Instruct,
#: HuggingFaceTB/SmolVLM-256M-Instruct: their safetensors totals).
PARAMS = {"llava-1.5-7b": 7_063_427_072, "qwen2.5-vl-7b": 8_292_166_656, "gemma-3-4b": 4_300_079_472,
          "qwen3-vl-8b": 8_767_123_696, "smolvlm-256m": 256_484_928}


def test_every_family_has_a_released_count() -> None:
    assert sorted(PARAMS) == sorted(FAMILIES)
    with pytest.raises(ValueError, match="unknown vision family 'idefics'; known: llava-1.5-7b"):
        family("idefics")
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        shaped_config("llava-1.5-7b", "huge")


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_inline_configs_are_the_released_shapes(name: str) -> None:
    """HF transformers' own class for each inline config.json, on the meta device: the released parameter count."""
    import transformers

    config = transformers.AutoConfig.for_model(**shaped_config(name))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_gpu_presets_build_on_the_meta_device(name: str) -> None:
    """tokenmill's model of each preset (its config read by config_from_hf, the BERT tokenizer's image token ids),
    parameters counted on the meta device; a family the registry does not run yet is skipped, as the bench does."""
    from engine.model.registry import build_model

    missing = family_missing(name)
    if missing:
        pytest.skip(missing)
    cfg, images, tok = vision_gpu.vision_preset(name, tokenizer_folder(None))
    holder = shaped_config(name)
    for key in family(name).vocab_fields[-1]:
        holder = holder[key]
    assert cfg.vocab_size == holder and len(tok) <= cfg.vocab_size
    image_token = next(iter(family(name).tokens.values()))  # the token the features fill (the first listed)
    assert cfg.vision.image_token_id == tok.convert_tokens_to_ids(image_token)
    # the prompt's placeholder: the image token itself, or Gemma 3's <start_of_image> that expands to its soft tokens
    assert images.placeholder_id == images.hf.image_token_id == tok.convert_tokens_to_ids(images.image_token)
    with torch.device("meta"):
        model = build_model(cfg, 4096)
    if cfg.tie_word_embeddings:  # Gemma 3: one matrix, shared as random_model shares it
        model.tie_weights()
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]
    assert all(p.is_meta for p in model.parameters())


def test_llava_preset_reads_the_released_llava_fields() -> None:
    cfg, _, _ = vision_gpu.vision_preset("llava-1.5-7b", tokenizer_folder(None))
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads) == (32, 4096, 11008, 32)
    v = cfg.vision
    assert (v.num_layers, v.hidden_size, v.image_size, v.patch_size, v.tokens_per_image) == (24, 1024, 336, 14, 576)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_unless_grown(tmp_path) -> None:
    from engine.loading.model_files import resolve_model_path
    from engine.text.tokenizer import Tokenizer

    def smollm2() -> object:  # 49,152 tokens: over LLaVA-1.5's 32,064
        return Tokenizer.from_model_path(resolve_model_path(None)).hf_tokenizer

    with pytest.raises(ValueError, match="llava-1.5-7b: the tokenizer has 49153 tokens, over the vocabulary's 32064"):
        with_tokenizer("llava-1.5-7b", "tiny", smollm2(), tmp_path / "refused")
    config = with_tokenizer("llava-1.5-7b", "tiny", smollm2(), tmp_path, grow_vocab=True)
    assert config["vocab_size"] == config["text_config"]["vocab_size"] == 49153
    assert config["image_token_index"] == 49152
    assert (tmp_path / "processor_config.json").is_file() and (tmp_path / "tokenizer.json").is_file()


def test_the_pictures_and_questions_are_fixed_and_varied() -> None:
    sizes = {picture(i).size for i in range(6)}
    assert len(sizes) == 6 and (1024, 768) in sizes and (200, 300) in sizes
    assert picture(3).tobytes() == picture(3).tobytes() and picture(3).tobytes() != picture(9).tobytes()
    assert picture(0).mode == "RGB"
    qs = questions(3, 1)
    assert len(qs) == 3 and all(isinstance(q, str) and q for q in qs) and qs[0] == questions(1, 1)[0]


def test_the_gpu_preset_runs_at_tiny_scale_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rows = vision_gpu.main(["--device", "cpu", "--dtype", "float32", "--tiny", "--images", "3", "--max-tokens", "3"])
    out = capsys.readouterr().out
    runs = [n for n in FAMILIES if family_missing(n) is None]
    assert [r["family"] for r in rows] == runs
    for n in set(FAMILIES) - set(runs):
        assert f"{n}: skipped: tokenmill's registry has no" in out
    for r in rows:
        assert r["images"] == 3 and r["output_tokens"] == 9 and r["prompt_tokens"] > 3 * 16
        assert r["images_per_dollar"] == pytest.approx(3 / (r["seconds"] / 3600 * 3.0), rel=1e-4, abs=1)  # rounded to 1
    assert "out tok/$" in out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_cpu_side_by_side_runs_at_tiny_scale(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    if family_missing(name):
        pytest.skip(family_missing(name))
    rows = vision.main(["--family", name, "--size", "tiny", "--images", "3", "--max-tokens", "3",
                        "--hf-batches", "2,3", "--no-vllm"])
    assert [(r["system"], r["settings"]) for r in rows] == [("tokenmill", "defaults"), ("hf", "batch 2"),
                                                             ("hf", "batch 3")]
    for r in rows:
        assert r["images"] == 3 and r["output_tokens"] == 9 and r["images_per_s"] > 0 and r["load_average"] >= 0
    assert "vs best peer" in capsys.readouterr().out


def test_a_family_the_registry_lacks_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from engine.model import registry

    monkeypatch.delitem(registry.MODELS, "llava")
    assert vision.main(["--size", "tiny", "--no-vllm"]) == []
    assert capsys.readouterr().out == "llava-1.5-7b: skipped: tokenmill's registry has no 'llava' yet\n"
    assert vision_gpu.main(["--device", "cpu", "--tiny", "--family", "llava-1.5-7b"]) == []
