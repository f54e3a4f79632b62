"""A classifier folder whose config.json has no id2label (transformers 5 saves none for the default LABEL_i names,
and no num_labels either for its default of 2): tokenmill reads it as HF does, LABEL_0 .. LABEL_{n-1}, and
classifies as HF's BertForSequenceClassification does on real texts (softmax of its logits within 1e-5, fp32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine

_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


@pytest.mark.parametrize("num_labels", [2, 3])
def test_labels_without_id2label_are_hf_s_label_i(tmp_path: Path, minilm_folder: str, gsm8k_questions: list[str],
                                                  num_labels: int) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(num_labels)
    hf = BertForSequenceClassification(BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, num_labels=num_labels)).eval()
    with torch.no_grad():
        hf.classifier.weight.mul_(50.0)  # HF's init gives logits near 0: wider, so the argmax differs by row
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    if num_labels == 3:  # transformers saved LABEL_i for 3: drop it, keep num_labels (a hand-written config's way)
        config = {**{k: v for k, v in config.items() if k not in ("id2label", "label2id")}, "num_labels": 3}
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert "id2label" not in config and ("num_labels" in config) == (num_labels == 3)
    for name in _TOKENIZER:
        shutil.copy(Path(minilm_folder) / name, tmp_path / name)

    engine = LLMEngine.from_model(str(tmp_path), EngineConfig(device="cpu", dtype="float32"))
    names = tuple(f"LABEL_{i}" for i in range(num_labels))
    assert engine.model_config.labels == names
    texts = gsm8k_questions[60:72]
    out = engine.classify(texts)
    rows = [ids for ids, _ in engine.tokenizer.encode_truncated(texts, engine.pooling_runner.max_length)]
    with torch.inference_mode():
        probs = torch.softmax(torch.cat([hf(input_ids=torch.tensor([r])).logits for r in rows]), -1).numpy()
    np.testing.assert_allclose(np.stack([o.scores for o in out]), probs, atol=1e-5, rtol=0)
    assert [o.label for o in out] == [names[i] for i in probs.argmax(-1)]
    assert BertConfig.from_pretrained(tmp_path).id2label == dict(enumerate(names))  # HF reads the folder alike
