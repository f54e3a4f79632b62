"""ModernBERT (registry "modernbert": engine.model.modernbert) against HF transformers' own ModernBertModel and
sentence-transformers: a tiny random-weight model (4 layers, global every 3rd from layer 0: global, local, local,
global; a local window of 16 tokens, 8 each side, well under the rows' up to 96 tokens; non-default RoPE bases)
saved with save_pretrained beside the MiniLM tokenizer and sentence-transformers files (mean pooling, Normalize),
loaded by LLMEngine from that folder and fed variable-length real texts (packed) vs HF's padded batch: last hidden
states within 1e-4 in fp32, embeddings equal to sentence-transformers' (cosine >= 0.99999). The config reader
reads transformers 4's fields too and refuses what the model does not implement, naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.config import ModelConfig
from engine.layers.encoder_attention import EncoderMetadata
from engine.model.hf_config import config_from_hf
from engine.model.registry import build_model

MAX_POSITIONS, MAX_SEQ_LENGTH = 128, 96  # sentence_bert_config's max_seq_length cuts the longer texts at 96
WINDOW = 16  # local_attention: |i - j| <= 8
THETAS = (80_000.0, 5_000.0)  # global_rope_theta, local_rope_theta (not HF's defaults: the reader must read them)
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _st_files(folder: Path) -> None:
    """sentence-transformers' files: Transformer (max_seq_length 96), mean Pooling, Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH,
                                                                  "do_lower_case": False}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                 "pooling_mode_mean_tokens": True}))
    (folder / "2_Normalize").mkdir()


@pytest.fixture(scope="module")
def tiny_modernbert(tmp_path_factory: pytest.TempPathFactory, minilm_folder: str) -> tuple[Path, object]:
    """A 4-layer ModernBERT of random O(1) weights (HF ModernBertModel, hidden 64, 4 heads, GeGLU of 96, the MiniLM
    vocabulary and special ids) saved with the MiniLM tokenizer and the sentence-transformers files; the HF model."""
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    cfg = ModernBertConfig(vocab_size=30522, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=4, global_attn_every_n_layers=3, local_attention=WINDOW,
                           max_position_embeddings=MAX_POSITIONS, global_rope_theta=THETAS[0],
                           local_rope_theta=THETAS[1], pad_token_id=0, bos_token_id=101, eos_token_id=102,
                           cls_token_id=101, sep_token_id=102)
    model = ModernBertModel(cfg).eval()
    with torch.no_grad():  # HF's init (std 0.02, norms at 1) would hide a wrong block: O(1) activations instead
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name else 0.1))
    folder = tmp_path_factory.mktemp("tiny-modernbert")
    model.save_pretrained(folder)
    for name in _TOKENIZER:
        shutil.copy(Path(minilm_folder) / name, folder / name)
    _st_files(folder)
    return folder, model


@pytest.fixture(scope="module")
def engine(tiny_modernbert: tuple[Path, object]) -> LLMEngine:
    return LLMEngine.from_model(str(tiny_modernbert[0]), EngineConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def texts(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    """24 real texts of 10 to over 96 tokens."""
    return [t for pair in zip(gsm8k_questions[:12], alpaca_instructions[180:192], strict=True) for t in pair]


def test_config_reads_modernbert(engine: LLMEngine) -> None:
    cfg = engine.model_config
    assert (cfg.architecture, cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (
        "modernbert", WINDOW // 2, *THETAS)
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention", "full_attention")
    assert (cfg.rms_norm_eps, cfg.hidden_act, cfg.num_kv_heads, cfg.tie_word_embeddings) == (1e-5, "gelu", 4, False)
    assert engine.tasks == ("embed", "score") and engine.pooling_runner.max_length == MAX_SEQ_LENGTH


def _hf_hidden(hf: object, rows: list[list[int]]) -> torch.Tensor:
    """HF's last hidden states of `rows` as one right-padded batch with its mask, the real tokens' [T, hidden]."""
    padded = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)
    mask = torch.zeros_like(padded)
    for b, r in enumerate(rows):
        padded[b, :len(r)], mask[b, :len(r)] = torch.tensor(r), 1
    with torch.inference_mode():
        return hf(input_ids=padded, attention_mask=mask).last_hidden_state[mask.bool()]  # type: ignore[operator]


def test_hidden_states_equal_hf(tiny_modernbert: tuple[Path, object], engine: LLMEngine, texts: list[str]) -> None:
    _, hf = tiny_modernbert
    rows = [ids for ids, _ in engine.tokenizer.encode_truncated(texts, MAX_SEQ_LENGTH)]
    lens = [len(r) for r in rows]
    assert min(lens) < WINDOW and max(lens) == MAX_SEQ_LENGTH  # some rows within the window, most beyond it
    ids = torch.tensor([t for r in rows for t in r])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        ours = engine.model(ids, positions, [], EncoderMetadata.of(lens, torch.device("cpu")))
    theirs = _hf_hidden(hf, rows)
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (sum(lens), 64)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)

    wide = hf.config.local_attention  # type: ignore[attr-defined]
    hf.config.local_attention = 2 * MAX_POSITIONS  # type: ignore[attr-defined]  # the local layers see every key:
    try:  # the window changes the states, so the match above holds the window's width
        assert (_hf_hidden(hf, rows) - ours).abs().max() > 1e-2
    finally:
        hf.config.local_attention = wide  # type: ignore[attr-defined]


def test_embeddings_equal_sentence_transformers(tiny_modernbert: tuple[Path, object], engine: LLMEngine,
                                                texts: list[str]) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(tiny_modernbert[0]), device="cpu")
    theirs = st.encode(texts, batch_size=8, convert_to_numpy=True)
    out = engine.embed(texts)
    ours = np.stack([o.embedding for o in out])
    assert ours.shape == theirs.shape == (len(texts), 64)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.99999 and np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    whole = [len(r) for r in st.tokenizer(texts)["input_ids"]]
    assert [o.num_prompt_tokens for o in out] == [min(n, MAX_SEQ_LENGTH) for n in whole]
    assert [o.truncated for o in out] == [n > MAX_SEQ_LENGTH for n in whole] and any(o.truncated for o in out)


def test_the_batch_plan_changes_no_vector(engine: LLMEngine, texts: list[str]) -> None:
    """Smaller batches (other paddings, other band masks) give the same vectors: rows never see each other."""
    narrow = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=3,
                                             max_num_batched_tokens=128))
    a = np.stack([o.embedding for o in engine.embed(texts)])
    b = np.stack([o.embedding for o in narrow.embed(texts)])
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


#: config.json of a transformers 4 ModernBERT (answerdotai/ModernBERT-base's fields): no layer_types, no
#: rope_parameters.
V4_CONFIG = dict(model_type="modernbert", architectures=["ModernBertModel"], vocab_size=50368, hidden_size=768,
                 intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12, hidden_activation="gelu",
                 max_position_embeddings=8192, norm_eps=1e-5, norm_bias=False, global_rope_theta=160000.0,
                 local_rope_theta=10000.0, global_attn_every_n_layers=3, local_attention=128, attention_bias=False,
                 mlp_bias=False, classifier_pooling="mean", pad_token_id=50283, bos_token_id=50281,
                 eos_token_id=50282, cls_token_id=50281, sep_token_id=50282, tie_word_embeddings=True)


def test_a_transformers_4_config_reads_alike(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config_from_hf(V4_CONFIG)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [0, 3, 6, 9, 12, 15, 18, 21]
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta, cfg.head_dim) == (64, 160000.0, 10000.0, 64)
    assert cfg.max_row_tokens == 8192 and not cfg.tie_word_embeddings
    assert "not read" not in caplog.text  # every field is read, refused or known to be training-only


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_activation", "silu", "hidden_activation='silu'"), ("norm_bias", True, "norm_bias=True"),
    ("attention_bias", True, "attention_bias=True"), ("mlp_bias", True, "mlp_bias=True"),
    ("local_attention", 1, "local_attention=1"), ("num_attention_heads", 10, "not a multiple"),
    ("layer_types", ["full_attention"] * 21 + ["chunked_attention"], "layer_types"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}, "sliding_attention"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn'"),
])
def test_what_the_model_does_not_implement_is_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        config_from_hf({**V4_CONFIG, field: value})


@pytest.mark.parametrize(("field", "value"), [("classifier_pooling", "max"), ("classifier_activation", "silu"),
                                               ("classifier_bias", True)])
def test_a_classifier_head_it_does_not_implement_is_refused(field: str, value: object) -> None:
    head = dict(V4_CONFIG, architectures=["ModernBertForSequenceClassification"], id2label={"0": "no", "1": "yes"})
    assert config_from_hf(head).classifier_pooling == "mean" and config_from_hf(head).labels == ("no", "yes")
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        config_from_hf({**head, field: value})


SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=4,
             head_dim=8, max_position_embeddings=64, architecture="modernbert", hidden_act="gelu",
             layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=2,
             rope_local_theta=1e4)


def test_layer_0_has_no_attention_norm_and_other_families_are_refused() -> None:
    """(The entry's names against the built model: tests/engine/model/test_registry.py.) HF's layer 0 normalizes
    nothing before attention (nn.Identity: no parameter); a config of another family's fields is refused."""
    with torch.device("meta"):
        names = set(build_model(ModelConfig(**SHAPE), 1).state_dict())
        assert "layers.0.attn_norm.weight" not in names and "layers.1.attn_norm.weight" in names
        with pytest.raises(ValueError, match=r"does not build \['qkv_bias'\]"):
            build_model(ModelConfig(**SHAPE, qkv_bias=True), 1)


def test_the_window_mask_is_a_symmetric_band() -> None:
    """EncoderMetadata.windowed: |i - j| <= half within a row's real keys; a padded query sees its row's real keys;
    no mask when every row fits in the band."""
    meta = EncoderMetadata.of([5, 3], torch.device("cpu"))
    band = meta.windowed(1).attn_mask
    assert band is not None and band.shape == (2, 1, 5, 5)
    assert band[0, 0].int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1],
                                         [0, 0, 0, 1, 1]]
    assert band[1, 0].int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 0, 0], [1, 1, 1, 0, 0],
                                         [1, 1, 1, 0, 0]]
    assert meta.windowed(4) is meta
    with pytest.raises(ValueError, match="half width"):
        meta.windowed(-1)
