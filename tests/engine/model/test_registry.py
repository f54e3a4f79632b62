"""engine.model.registry: every architecture has a model, `build_model` is the only place engine/ names a model class,
and the KV cache layout read from a config (memory fit's) is the one the built model declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.core.kv_cache_spec import KVCacheSpec
from engine.model.architectures import ARCHITECTURES
from engine.model.base import ModelBase
from engine.model.registry import CLASSIFIERS, MODELS, build_model, entry_of, kv_cache_layout, model_entry

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "engine"
#: Where no module but the registry and a model's own may name a model class (tests may).
SOURCES = ("engine", "pipeline", "jobs", "schemas", "bench", "infra")
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=8, max_position_embeddings=64)


def test_every_architecture_has_a_model() -> None:
    assert {a.name for a in ARCHITECTURES} == set(MODELS)
    for a in ARCHITECTURES:
        assert issubclass(model_entry(a.name).model_class(), ModelBase)
    assert model_entry("mistral") is MODELS["llama"]  # an HF model_type finds its family's entry
    with pytest.raises(ValueError, match="not supported"):
        model_entry("t5")


def test_no_module_outside_the_registry_names_a_model_class() -> None:
    """A model class is named by the registry (which builds it) and by the module defining it, nowhere else in
    engine/ (nor pipeline, jobs, schemas, bench, infra): everything else holds a ModelBase."""
    classes = {entry.model_class() for entry in (*MODELS.values(), *CLASSIFIERS.values())}
    names = {cls.__name__ for cls in classes}
    allowed = {ENGINE / "model" / "registry.py"} | {ROOT / (cls.__module__.replace(".", "/") + ".py")
                                                   for cls in classes}
    pattern = re.compile(r"\b(" + "|".join(sorted(names)) + r")\b")
    files = sorted(p for folder in SOURCES if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob("*.py"))
    assert ENGINE / "worker" / "model_runner.py" in files  # the walk saw the code
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for path in files if path not in allowed
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], "model classes named outside engine/model/registry.py:\n" + "\n".join(found)


MOE = dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
GEMMA = dict(architecture="gemma2", sandwich_norms=True, embedding_scale=2.0)


@pytest.mark.parametrize(("family", "field", "other"), [
    (MOE, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}, GEMMA),
    (GEMMA, {"sandwich_norms": True}, MOE), (GEMMA, {"embedding_scale": 2.0}, MOE),
    (GEMMA, {"final_logit_softcapping": 30.0}, MOE), (GEMMA, {"rope_local_theta": 1e4}, MOE),
], ids=["experts", "sandwich", "embedding_scale", "logit_cap", "local_rope"])
def test_a_model_refuses_the_fields_of_another_family(family: dict, field: dict, other: dict) -> None:
    """A field of a family file's structure is built by that family's class and refused by the generic decoder
    (llama) and by another family's class: never run as something else."""
    with torch.device("meta"):
        build_model(ModelConfig(**SHAPE, **{**family, **field}), 1)
        for arch in ({}, other):
            with pytest.raises(ValueError, match="does not build"):
                build_model(ModelConfig(**SHAPE, **{**arch, **field}), 1)


@pytest.mark.parametrize("options", [
    {}, {"sliding_window": 6},
    {"sliding_window": 6, "layer_types": ("sliding_attention", "full_attention") * 2},
], ids=["full", "sliding", "mixed"])
def test_the_layout_from_the_config_is_the_models(options: dict) -> None:
    cfg = ModelConfig(**SHAPE, **options)
    with torch.device("meta"):
        model = build_model(cfg, 1)
    assert model.kv_cache_specs == kv_cache_layout(cfg)
    window = cfg.sliding_window
    expected = [KVCacheSpec("sliding", 2, 8, window=window) if window and t != "full_attention"
                else KVCacheSpec("full", 2, 8) for t in cfg.layer_types or ("",) * cfg.num_layers]
    assert list(kv_cache_layout(cfg)) == expected
    assert [layer.self_attn.sliding_window for layer in model.layers] == [s.window for s in expected]


def test_forward_takes_token_ids_or_input_embeddings_and_returns_hidden_states() -> None:
    """forward(ids) == forward(inputs_embeds=embed(ids)) (Gemma's embedding scale is embed's), hidden states
    [T, hidden]; the LM head is the separate compute_logits step."""
    from engine.layers.attention import AttentionMetadata, private_kv_cache
    from engine.loading.presets import random_model

    cfg = ModelConfig(**SHAPE, architecture="gemma2", embedding_scale=2.0, sandwich_norms=True)
    model = random_model(cfg, torch.float32, torch.device("cpu"), max_positions=16)
    ids = torch.tensor([3, 1, 4, 1, 5])
    n, cpu = len(ids), torch.device("cpu")

    def run(**inputs: torch.Tensor | None) -> torch.Tensor:
        caches = [private_kv_cache(n, 16, s.num_kv_heads, s.head_size, torch.float32, cpu)
                  for s in model.kv_cache_specs]
        return model(inputs.get("input_ids"), torch.arange(n), caches, AttentionMetadata.single_prefill(n, 16, cpu),
                     inputs_embeds=inputs.get("inputs_embeds"))

    with torch.no_grad():
        hidden = run(input_ids=ids)
        assert hidden.shape == (n, cfg.hidden_size)
        assert torch.equal(run(inputs_embeds=model.embed(ids)), hidden)
        assert model.compute_logits(hidden).shape == (n, cfg.vocab_size)
        for both_or_neither in ({"input_ids": ids, "inputs_embeds": model.embed(ids)}, {}):
            with pytest.raises(ValueError, match="input_ids or inputs_embeds"):
                run(**both_or_neither)


#: ModernBERT's local layer (a window of 1 token each side: the 3-token row's band) and two RoPE bases.
_MODERNBERT = dict(layer_types=("full_attention", "sliding_attention") * 2, sliding_window=1, rope_local_theta=1e4)


@pytest.mark.parametrize(("arch", "fields"), [
    ("bert", dict(type_vocab_size=2)), ("xlm-roberta", dict(type_vocab_size=1, position_padding_idx=1)),
    ("modernbert", _MODERNBERT)])
def test_the_encoder_entries_declare_their_encoder(arch: str, fields: dict) -> None:
    """The "bert", "xlm_roberta" and "modernbert" entries: their parameter names and shapes from the config alone
    are the built encoder's state dict, it keeps no KV cache, embeds and does not generate; forward(ids) ==
    forward(inputs_embeds=embed(ids)) (no pad token among the ids), no LM head."""
    from engine.layers.encoder_attention import EncoderMetadata
    from engine.loading.presets import random_model
    from engine.model.registry import model_tasks

    cfg = ModelConfig(**{**SHAPE, "num_kv_heads": 4}, architecture=arch, hidden_act="gelu", tie_word_embeddings=False,
                      **fields)
    entry = model_entry(arch)
    with torch.device("meta"):
        model = build_model(cfg, 1)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == entry.param_shapes(cfg)
    assert kv_cache_layout(cfg) == model.kv_cache_specs == (KVCacheSpec("none"),) * cfg.num_layers
    assert model_tasks(arch) == ("embed", "score") and model_tasks("qwen2") == ("generate",)  # score: by cosine
    model = random_model(cfg, torch.float32, torch.device("cpu"), max_positions=16)
    ids, meta = torch.tensor([3, 2, 4, 2, 5]), EncoderMetadata.of([3, 2], torch.device("cpu"))
    positions = torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():
        hidden = model(ids, positions, [], meta)
        assert hidden.shape == (5, cfg.hidden_size)
        assert torch.equal(model(None, positions, [], meta, inputs_embeds=model.embed(ids)), hidden)
        with pytest.raises(NotImplementedError, match="without an LM head"):
            model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "modernbert", "llama", "qwen2"])
def test_the_classifier_entries_declare_their_heads(arch: str) -> None:
    """A config with labels builds its family's sequence classifier: the names and shapes from the config alone are
    the built model's state dict (head included, no LM head), and it classifies only."""
    from engine.model.registry import model_tasks

    encoder = arch in ("bert", "xlm-roberta", "modernbert")
    extra = dict(hidden_act="gelu", num_kv_heads=4, **(_MODERNBERT if arch == "modernbert" else
                                                         dict(type_vocab_size=2))) if encoder else {}
    cfg = ModelConfig(**{**SHAPE, **extra}, architecture=arch, tie_word_embeddings=False, labels=("a", "b", "c"))
    with torch.device("meta"):
        model = build_model(cfg, 1)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == entry_of(cfg).param_shapes(cfg) and "lm_head.weight" not in shapes
    assert shapes["classifier.out_proj.weight" if arch == "xlm-roberta" else "classifier.weight" if encoder
                  else "score.weight"] == (3, SHAPE["hidden_size"])
    assert model_tasks(arch, classifier=True, num_labels=3) == ("classify",)
    assert model_tasks(arch, classifier=True, num_labels=1) == ("classify", "score")  # a cross-encoder
    with pytest.raises(ValueError, match="no sequence classifier"):
        model_tasks("gemma2", classifier=True)


def test_score_takes_a_cross_encoder_or_an_embedding_model() -> None:
    """"score" follows from the other tasks: an embedding model (cosine) and a classifier of one label (a
    cross-encoder) score; a causal LM and a classifier of several labels cannot, in one line saying why and what
    they do instead."""
    from engine.model.registry import task_problem

    assert task_problem("bert", "score") is None and task_problem("xlm-roberta", "score", True, 1) is None
    several = task_problem("bert", "score", True, 3) or ""
    assert "of 3 labels cannot score text pairs" in several and "--task classify" in several
    causal = task_problem("qwen2", "score") or ""
    assert "cannot score text pairs" in causal and "--task generate" in causal and "\n" not in causal
