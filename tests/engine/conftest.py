"""Fixtures of the engine tests shared by more than one file (each GGUF file's metadata parsed once), and tests/engine
on sys.path for the helper modules beside this file (attention_steps, squeezed_pool, tiny_mistral, triton_testing)
that the tests in its subfolders (which mirror engine/'s subpackages) import."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session", autouse=True)
def gguf_parsed_once(gguf_path: str) -> dict:
    """Each GGUF file's metadata parsed once while unchanged (tests/gguf_models.py parsing_each_gguf_once): every test
    GGUF carries SmolLM2's 49k-token vocabulary, whose parse (engine.loading.gguf_file.open_gguf) is about 0.2 CPU-s,
    and the tests load a file several times (greedy, config, quantized paths; the default model in many files). The
    loaders only read a parse, so what they load is unchanged. The default model's parse is kept for the session, those
    of the 6 test files opened last beside it. Returns the parses, by key."""
    from gguf_models import parsing_each_gguf_once

    with parsing_each_gguf_once(keep=6, pinned=[gguf_path]) as parsed:
        yield parsed


@pytest.fixture(scope="session")
def ref(gguf_path: str):
    """The real default model as `engine.loading.open_model.open_model` returns it in fp32 on the CPU (the GGUF's Q4_1
    weights dequantized, separate projections, plain nn.Linear): the reference of test_int4.py and
    test_int4_calibration.py, loaded once per test process. Read-only: a test that changes a model deep-copies
    `ref.model` first."""
    from engine.loading.open_model import open_model

    return open_model(gguf_path, torch.float32, torch.device("cpu"), quantization="none")



@pytest.fixture(params=["this-cpu", "no-vnni"])
def int8_qmax(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """The largest |q| of int8 weights that the W8A8 kernel sums exactly, under which the test runs: this CPU's own
    (engine.quant.int8_linear.int8_weight_qmax: 127 with VNNI), and 63, that of a CPU without VNNI (AVX2-only,
    AVX512F-only), set through that one function, which the loading (stored W8A8 integers kept or dequantized),
    `quantization int8` (7-bit weights) and the kernel all ask. So both kinds' paths run on every machine: on 7-bit
    weights the kernel's int32 sums are exact on both kinds, so the arithmetic is the no-VNNI machine's. (`make
    test-cpu-kinds` runs the marked tests as an AVX2 machine computes, with oneDNN's own kernels capped.) Skips where
    torch has no oneDNN int8 ops."""
    import engine.quant.int8_linear as int8_linear

    if not int8_linear.int8_available():
        pytest.skip("torch has no oneDNN int8 ops here")
    if request.param == "no-vnni":
        monkeypatch.setattr(int8_linear, "int8_weight_qmax", lambda: 63.0)
    return int8_linear.int8_weight_qmax()
