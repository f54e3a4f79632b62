"""XLM-RoBERTa (registry "xlm_roberta": engine.model.bert with XLM-R's config values) against HF transformers' own
XLMRobertaModel: a tiny random-weight model saved with save_pretrained beside a tiny SentencePiece-style (Unigram,
Metaspace) tokenizer trained here on real texts, loaded by LLMEngine from that folder and fed variable-length real
texts (packed) vs HF's padded batch: last hidden states within 1e-4 in fp32, mean-pooled embeddings equal to HF's
mean over the mask; positions start past padding_idx and skip a pad token spelt in a text, as HF's do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.layers.encoder_attention import EncoderMetadata

MAX_POSITIONS = 66  # rows of at most 64 tokens (positions 2..65): the longer texts are cut
PAD = 1  # XLMRobertaConfig's pad_token_id, the position embedding's padding_idx


def _unigram_tokenizer(texts: list[str], folder: Path) -> None:
    """A 300-piece Unigram tokenizer (XLM-R's kind: Metaspace pieces, <s> $A </s>) trained on `texts`, saved to
    `folder` (tokenizer.json, tokenizer_config.json) with XLM-R's special token ids (<s> 0, <pad> 1, </s> 2, <unk>
    3)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=300, unk_token="<unk>",
                                                           special_tokens=["<s>", "<pad>", "</s>", "<unk>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>", cls_token="<s>", sep_token="</s>").save_pretrained(folder)


@pytest.fixture(scope="module")
def texts(gsm8k_questions: list[str], alpaca_instructions: list[str]) -> list[str]:
    """17 real texts of about 10 to over 64 tokens, one of them holding a literal "<pad>" (parsed as the pad
    token, as sentence-transformers' tokenizer call parses it)."""
    mixed = [t for pair in zip(gsm8k_questions[:8], alpaca_instructions[180:188], strict=True) for t in pair]
    return [*mixed, f"{alpaca_instructions[3]} <pad> {gsm8k_questions[20]}"]


@pytest.fixture(scope="module")
def tiny_xlmr(tmp_path_factory: pytest.TempPathFactory, gsm8k_questions: list[str],
              alpaca_instructions: list[str]) -> tuple[Path, object]:
    """A 2-layer XLM-RoBERTa of random weights (HF XLMRobertaModel, hidden 64, 4 heads, one token type, LayerNorm
    epsilon 1e-5 as multilingual-e5's) saved with the tokenizer above; the HF model itself."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    folder = tmp_path_factory.mktemp("tiny-xlmr")
    _unigram_tokenizer(gsm8k_questions[:300] + alpaca_instructions[:300], folder)
    torch.manual_seed(0)
    cfg = XLMRobertaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=MAX_POSITIONS, type_vocab_size=1,
                           layer_norm_eps=1e-5, pad_token_id=PAD, bos_token_id=0, eos_token_id=2)
    model = XLMRobertaModel(cfg, add_pooling_layer=True).eval()
    with torch.no_grad():  # O(1) activations and LayerNorms away from (1, 0), as test_bert_hf_parity's
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "LayerNorm" in name or p.dim() == 1 else 0.1))
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def engine(tiny_xlmr: tuple[Path, object]) -> LLMEngine:
    return LLMEngine.from_model(str(tiny_xlmr[0]), EngineConfig(device="cpu", dtype="float32"))


def test_config_reads_xlm_roberta(engine: LLMEngine) -> None:
    cfg = engine.model_config
    assert (cfg.architecture, cfg.type_vocab_size, cfg.position_padding_idx) == ("xlm-roberta", 1, PAD)
    assert cfg.rms_norm_eps == 1e-5 and engine.tasks == ("embed", "score")
    # the tokenizer allows ~1e30 tokens: rows stop at the positions past padding_idx, not at max_position_embeddings
    assert cfg.max_row_tokens == engine.pooling_runner.max_length == MAX_POSITIONS - PAD - 1


def test_hidden_states_and_mean_pooling_equal_hf(tiny_xlmr: tuple[Path, object], engine: LLMEngine,
                                                 texts: list[str]) -> None:
    _, hf = tiny_xlmr
    limit = MAX_POSITIONS - PAD - 1
    rows = [ids for ids, _ in engine.tokenizer.encode_truncated(texts, limit)]
    lens = [len(r) for r in rows]
    assert min(lens) < 30 and max(lens) == limit and rows[0][0] == 0 and rows[0][-1] == 2  # <s> ... </s>
    assert PAD in rows[-1][1:-1]  # the text's "<pad>": HF gives it position padding_idx and does not count it
    ids = torch.tensor([t for r in rows for t in r])
    positions = torch.cat([torch.arange(n) for n in lens])
    padded = torch.full((len(rows), max(lens)), PAD, dtype=torch.int64)
    mask = torch.zeros_like(padded)
    for b, r in enumerate(rows):
        padded[b, :len(r)], mask[b, :len(r)] = torch.tensor(r), 1
    with torch.inference_mode():
        ours = engine.model(ids, positions, [], EncoderMetadata.of(lens, torch.device("cpu")))
        theirs = hf(input_ids=padded, attention_mask=mask).last_hidden_state[mask.bool()]
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape == (sum(lens), 64)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)

    out = engine.embed(texts)  # no modules.json: mean pooling of every token, no normalization
    starts = np.cumsum([0, *lens[:-1]])
    means = torch.stack([theirs[s:s + n].mean(0) for s, n in zip(starts, lens, strict=True)])
    np.testing.assert_allclose(np.stack([o.embedding for o in out]), means.numpy(), atol=1e-4, rtol=0)
    assert [o.num_prompt_tokens for o in out] == lens
    assert [o.truncated for o in out] == [len(r) > limit for r in engine.tokenizer.hf_tokenizer(texts)["input_ids"]]
    assert any(o.truncated for o in out) and not all(o.truncated for o in out)


def test_positions_start_past_padding_idx(engine: LLMEngine) -> None:
    """Two packed rows, the second holding a pad token: HF's create_position_ids_from_input_ids row by row."""
    ids = torch.tensor([0, 7, 9, 2, 0, 5, PAD, 6, 2])
    rows = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4])
    assert engine.model.positions(ids, rows).tolist() == [2, 3, 4, 5, 2, 3, PAD, 4, 5]
    assert engine.model.positions(None, rows).tolist() == (rows + PAD + 1).tolist()  # inputs_embeds: no pads known
