"""Fixtures of the engine tests shared by more than one file, and tests/engine on sys.path for the helper modules
beside this file (attention_steps, squeezed_pool, tiny_mistral, triton_testing) that the tests in its subfolders
(which mirror engine/'s subpackages) import."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def ref(gguf_path: str):
    """The real default model as `engine.loading.quantized.load_model` returns it in fp32 on the CPU (the GGUF's Q4_1
    weights dequantized, separate projections, plain nn.Linear): the reference of test_int4.py and
    test_int4_calibration.py, loaded once per test process. Read-only: a test that changes a model deep-copies
    `ref.model` first."""
    from engine.loading.quantized import load_model

    return load_model(gguf_path, torch.float32, torch.device("cpu"), quantization="none")

