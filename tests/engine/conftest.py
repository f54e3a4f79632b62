"""Fixtures of the engine tests shared by more than one file."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def ref(gguf_path: str):
    """The real default model as `engine.quant.loading.load_model` returns it in fp32 on the CPU (the GGUF's Q4_1
    weights dequantized, separate projections, plain nn.Linear): the reference of test_int4.py and
    test_int4_calibration.py, loaded once per test process. Read-only: a test that changes a model deep-copies
    `ref.model` first."""
    from engine.quant.loading import load_model

    return load_model(gguf_path, torch.float32, torch.device("cpu"), quantization="none")

