"""tokenmill's LLM engine: a Llama-family decoder over a paged KV cache with continuous batching.

Imports only torch and its own small deps (gguf, transformers' tokenizer); knows nothing of Parquet, S3 or Dask.

NOTE: the names below load on first use (PEP 562), so `import engine.object_store` (pipeline/, the CLI's `status`)
does not pay for torch (~2 s); `from engine import LLMEngine` still works as before.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

# OpenMP's wait policy is read once, when torch loads libgomp, so it is set here, before the process's first
# `import torch` (the processes it starts, Dask workers among them, inherit it). By default libgomp's threads spin
# for up to 300,000 rounds at every barrier; when other work shares the cores (a Dask scheduler, a second job, a
# noisy neighbour, two pytest workers), a descheduled intra-op thread leaves its siblings spinning through their
# time slices: 32 AlpacaEval prompts at 2 threads beside two busy processes on a 2-core EPYC took 91 s, against
# 17 s at 1 thread and 17 s with PASSIVE (bench/README.md "OpenMP wait policy"). PASSIVE threads sleep at a barrier
# instead. A value the user set wins; `tokenmill doctor` shows the one in effect.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine, Prompt
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams, StructuredOutputsParams

_EXPORTS = {"EngineConfig": "engine.config", "ModelConfig": "engine.config", "LLMEngine": "engine.llm_engine",
            "Prompt": "engine.llm_engine", "RequestOutput": "engine.outputs",
            "SamplingParams": "engine.sampling_params", "StructuredOutputsParams": "engine.sampling_params"}

__all__ = ["EngineConfig", "LLMEngine", "ModelConfig", "Prompt", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    """Import `name`'s module on first use (PEP 562); AttributeError for a name the package does not export."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
