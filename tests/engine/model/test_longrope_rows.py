"""LongRoPE's factors per row, as HF transformers' `generate` picks them (issue 51, item 8).

HF's `longrope_frequency_update` (transformers/modeling_rope_utils.py) chooses the factors of each forward call from
that call's sequence length, max(position_ids) + 1: a prompt of L tokens takes the long factors for every position
when L > original, else the short ones; when a sequence first passes the original context during generation,
Phi-3's `prepare_inputs_for_generation` drops the KV cache and encodes the whole sequence again (long factors). The
engine picks the same per row (engine.layers.rope.longrope_table_rows) and recomputes a row that crosses, so a row
below the original context equals HF although the engine's context (2048) is past it, and so does a row that
crosses it or starts above it. The tiny Phi-3 of
tests/engine/family_models.py here has an original context of 64 tokens (the prompts are cut to fit), from its
folder and from GGUF; prefix caching must not share a short row's keys with a long row.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

ORIGINAL = 64
FP32 = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256, block_size=16, max_num_seqs=8,
                    max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def phi3_64(tmp_path_factory: pytest.TempPathFactory, family_tok, tok_fields) -> tuple:
    """(HF model fp32 with original_max_position_embeddings 64, its HF folder, its GGUF file)."""
    from family_models import build_hf, save_folder, write_gguf

    root = tmp_path_factory.mktemp("phi3_64")
    folder = save_folder(build_hf("phi3", len(family_tok)), root / "phi3", family_tok)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["original_max_position_embeddings"] = ORIGINAL
    for rope in (cfg.get("rope_parameters"), cfg.get("rope_scaling")):
        if isinstance(rope, dict):
            rope["original_max_position_embeddings"] = ORIGINAL
            rope.pop("factor", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    assert model.config.rope_parameters["original_max_position_embeddings"] == ORIGINAL
    write_gguf(root / "phi3.gguf", "phi3", model, tok_fields)
    return model, folder, root / "phi3.gguf"


def _ours(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def test_rows_below_the_original_context_equal_hf(phi3_64, family_prompts) -> None:
    """A 56-token prompt with 8 new tokens stays within the original 64: HF's short factors throughout, from the
    first token on, from the folder and the GGUF."""
    from family_models import hf_generate

    model, folder, path = phi3_64
    prompts = [p[:56] for p in family_prompts[:4]]
    assert all(len(p) == 56 for p in prompts)
    want = hf_generate(model, prompts, 8)
    for source in (folder, path):
        assert _ours(LLMEngine.from_model(str(source), FP32), prompts, 8) == want


def test_rows_that_cross_or_start_above_equal_hf_generate(phi3_64, family_prompts) -> None:
    """A row that crosses position 64 mid-generation is encoded again with the long factors there, as HF's generate
    does; a prompt longer than 64 takes the long factors for every position. Both in one batch beside a row
    below, and again with chunked prefill and without prefix caching."""
    from family_models import hf_generate

    model, folder, _ = phi3_64
    prompts = [family_prompts[0][:50], max(family_prompts, key=len)[:80], family_prompts[2][:40]]
    assert [len(p) for p in prompts] == [50, 80, 40]
    want = hf_generate(model, prompts, 24)
    assert _ours(LLMEngine.from_model(str(folder), FP32), prompts, 24) == want
    chunked = EngineConfig(**{**FP32.__dict__, "max_num_batched_tokens": 24, "enable_prefix_caching": False})
    assert _ours(LLMEngine.from_model(str(folder), chunked), prompts, 24) == want


def test_prefix_cache_keeps_short_and_long_rows_apart(phi3_64, family_prompts) -> None:
    """A long prompt that extends a short one already run shares its tokens but not its keys (rotated with the
    short factors): its text equals HF's all the same, and a short row after it equals HF too."""
    from family_models import hf_generate

    model, folder, _ = phi3_64
    short = family_prompts[3][:48]
    long = short + family_prompts[4][:40]
    engine = LLMEngine.from_model(str(folder), FP32)
    assert _ours(engine, [short], 8) == hf_generate(model, [short], 8)
    assert _ours(engine, [long], 8) == hf_generate(model, [long], 8)
    assert _ours(engine, [short[:40]], 8) == hf_generate(model, [short[:40]], 8)


def test_table_rows_follow_hf_rule() -> None:
    """Rows of the RoPE table: the position itself (short factors) while the position and the length the KV cache
    started at are within the original context, else the long table's row (position + original)."""
    from engine.layers.rope import longrope_table_rows

    positions = torch.tensor([0, 5, 63, 64, 70, 0, 5])
    start_lens = torch.tensor([10, 10, 10, 10, 10, 65, 64])
    rows = longrope_table_rows(positions, start_lens, ORIGINAL)
    assert rows.tolist() == [0, 5, 63, 128, 134, 64, 5]
    assert longrope_table_rows(positions.numpy(), start_lens.numpy(), ORIGINAL).tolist() == rows.tolist()
