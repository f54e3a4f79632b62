"""Sequence classification models (engine.model.classifier_names says which HF architectures and heads): an encoder
(BERT, XLM-RoBERTa, ModernBERT) or a causal decoder whose `forward` gives hidden states as always, plus
`classify_logits`, the head on each row's pooled token. Built by the registry's classify entries
(engine.model.registry.CLASSIFIERS); run by engine.pooling.classifier.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model.architectures import get_architecture
from engine.model.bert import BertEncoderModel
from engine.model.decoder import LlamaModel
from engine.model.modernbert import ModernBertEncoderModel


class _Pooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class _RobertaHead(nn.Module):
    """XLM-RoBERTa's classification head: dense, tanh, out_proj (HF RobertaClassificationHead; dropout: training)."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


def _row_ends(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """int64 [B]: the index one past each row's last token in a packed batch of rows of `seq_lens` tokens."""
    return torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64, device=device), 0)


def _row_starts(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """int64 [B]: the index of each row's first token ([CLS] / <s>) in a packed batch of rows of `seq_lens` tokens."""
    return _row_ends(seq_lens, device) - torch.tensor(seq_lens, dtype=torch.int64, device=device)


class EncoderClassifier(BertEncoderModel):
    """BertForSequenceClassification (pooler dense + tanh on [CLS], `classifier`) or
    XLMRobertaForSequenceClassification (`classifier` = dense + tanh + out_proj on <s>) by cfg.architecture."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        h, n = cfg.hidden_size, len(cfg.labels)
        if get_architecture(cfg.architecture).name == "xlm_roberta":
            self.classifier: nn.Module = _RobertaHead(h, n)
        else:
            self.pooler = _Pooler(h)
            self.classifier = nn.Linear(h, n)

    def classify_logits(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Logits float32 [B, num_labels] of a packed batch: hidden [T, hidden] (model dtype) holding B rows of
        `seq_lens` tokens back to back; each row's first token ([CLS] / <s>) through the head."""
        first = hidden[_row_starts(seq_lens, hidden.device)]
        if hasattr(self, "pooler"):
            first = torch.tanh(self.pooler.dense(first))
        return self.classifier(first).float()


class _ModernBertHead(nn.Module):
    """ModernBertPredictionHead: norm(gelu(dense(x))), no biases (classifier_bias, norm_bias false), exact GELU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(x)))


class ModernBertClassifier(ModernBertEncoderModel):
    """ModernBertForSequenceClassification (HF modeling_modernbert.py): each row's [CLS] (cfg.classifier_pooling
    "cls") or the mean of its tokens ("mean") through `head` (_ModernBertHead), then `classifier` Linear
    [num_labels, hidden] with a bias."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        self.head = _ModernBertHead(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, len(cfg.labels))

    def classify_logits(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Logits float32 [B, num_labels] of a packed batch: hidden [T, hidden] (model dtype) holding B rows of
        `seq_lens` tokens back to back, each row pooled as cfg.classifier_pooling says, then the head."""
        if self.config.classifier_pooling == "mean":
            pooled = torch.stack([row.mean(0) for row in hidden.split(seq_lens)])
        else:
            pooled = hidden[_row_starts(seq_lens, hidden.device)]
        return self.classifier(self.head(pooled)).float()


class DecoderClassifier(LlamaModel):
    """Llama / Qwen2 ForSequenceClassification: the causal decoder with `score` Linear [num_labels, hidden] (no bias)
    in place of its LM head, on each row's last token."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        del self.lm_head
        self.score = nn.Linear(cfg.hidden_size, len(cfg.labels), bias=False)

    def compute_logits(self, hidden: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
        """A classifier has no LM head: raises ValueError (classify_logits is its head)."""
        raise ValueError(f"a {self.config.architecture} sequence classifier has no LM head; it classifies")

    def classify_logits(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Logits float32 [B, num_labels] of hidden [T, hidden] holding B rows of `seq_lens` tokens back to back:
        each row's last token through `score`."""
        return self.score(hidden[_row_ends(seq_lens, hidden.device) - 1]).float()
