"""Tiny random-weight sentence-transformers model folders for the pooling tests, written by sentence-transformers
itself (its modules' save), beside the default embedding model's (MiniLM) tokenizer: a Qwen3 embedding model shaped
as Qwen3-Embedding ships (the Transformer module over Qwen3Model, lasttoken pooling, Normalize; a tokenizer that
appends an end token to every text, left padding) and a BERT model with a Dense module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
MAX_SEQ_LENGTH = 80  # some of the real texts run past it: truncated alike


def perturb(model: torch.nn.Module, scale: float = 0.1) -> None:
    """Random O(1) weights (HF's init, std 0.02, gives near-equal hidden states for every text)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (2 * scale if "norm" in name.lower() or p.dim() == 1 else scale))


def copy_tokenizer(minilm_folder: str, folder: Path, end_token_only: bool = False) -> None:
    """MiniLM's tokenizer files into `folder`; end_token_only: its template appends [SEP] alone (no [CLS]), as
    Qwen3-Embedding's appends <|endoftext|>, and pads on the left."""
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_folder) / name, folder / name)
    if end_token_only:
        tok = json.loads((folder / "tokenizer.json").read_text())
        post = tok["post_processor"]
        post["single"] = post["single"][1:]
        post["pair"] = post["pair"][1:]
        post["special_tokens"].pop("[CLS]")
        (folder / "tokenizer.json").write_text(json.dumps(tok))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        # the tokenizer.json as it is (BertTokenizer would rebuild its [CLS] ... [SEP] template from the vocab)
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {**config, "padding_side": "left", "tokenizer_class": "PreTrainedTokenizerFast"}))


def save_qwen3_embedder(folder: Path, minilm_folder: str, tie: bool = False) -> Path:
    """A 2-layer Qwen3 embedding model (GQA 4/2 heads, q/k norms) saved by sentence-transformers as
    Transformer + Pooling("lasttoken") + Normalize into `folder`; tie: tied word embeddings. Returns `folder`."""
    import transformers as tf
    from sentence_transformers import SentenceTransformer, models

    torch.manual_seed(0)
    trunk = folder.parent / f"{folder.name}-trunk"
    cfg = tf.Qwen3Config(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                         tie_word_embeddings=tie)
    hf = tf.Qwen3ForCausalLM(cfg).eval()
    perturb(hf)
    hf.save_pretrained(trunk)
    copy_tokenizer(minilm_folder, trunk, end_token_only=True)
    transformer = models.Transformer(str(trunk), max_seq_length=MAX_SEQ_LENGTH)
    st = SentenceTransformer(modules=[transformer, models.Pooling(64, pooling_mode="lasttoken"), models.Normalize()],
                             device="cpu")
    st.save(str(folder))
    return folder


def save_bert_dense(folder: Path, minilm_folder: str, activation: torch.nn.Module, out_features: int = 48) -> Path:
    """A 2-layer BERT saved by sentence-transformers as Transformer + Pooling("mean") + Dense(64 -> out_features,
    `activation`) + Normalize into `folder`. Returns `folder`."""
    import transformers as tf
    from sentence_transformers import SentenceTransformer, models

    torch.manual_seed(1)
    trunk = folder.parent / f"{folder.name}-trunk"
    hf = tf.BertModel(tf.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, max_position_embeddings=128)).eval()
    perturb(hf)
    hf.save_pretrained(trunk)
    copy_tokenizer(minilm_folder, trunk)
    dense = models.Dense(64, out_features, activation_function=activation)
    perturb(dense, 0.3)
    st = SentenceTransformer(modules=[models.Transformer(str(trunk), max_seq_length=MAX_SEQ_LENGTH),
                                      models.Pooling(64, pooling_mode="mean"), dense, models.Normalize()],
                             device="cpu")
    st.save(str(folder))
    return folder
