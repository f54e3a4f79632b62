"""What a GGUF run's summary and accounting say of its quantization (issue 51, item 9): under auto, how many of the
file's weights stay INT4 as stored, as an already quantized HF folder's load report says."""

from __future__ import annotations

import torch

from engine.loading.open_model import open_model
from pipeline.accounting import quantization_label


def test_auto_gguf_names_its_int4_weights(gguf_path: str) -> None:
    loaded = open_model(gguf_path, torch.float32, torch.device("cpu"), quantization="auto")
    assert loaded.num_int4_modules > 0
    label = quantization_label("auto", loaded.quantization_loaded)
    assert label == f"auto (gguf: {loaded.num_int4_modules} weights INT4 as stored, the others dequantized exactly)"
