"""tokenmill's LLM engine: transformers from GGUF files or Hugging Face folders (the families of
engine.model.registry): causal decoders (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, the mixtures of experts
Qwen2/3-MoE, Mixtral, gpt-oss, and the vision-language LLaVA-1.5 / LLaVA-NeXT, Idefics3 / SmolVLM, Gemma 3,
Qwen2-VL / Qwen2.5-VL, Qwen3-VL) over a paged KV cache with continuous batching, and encoders without a KV cache
(BERT, XLM-RoBERTa, ModernBERT) for embeddings, scores and classification.

The front door is this package's top level, the public API only: LLMEngine (engine.llm_engine), EngineConfig
(engine.engine_config), ModelConfig with its RopeScaling and VisionConfig (engine.config, engine.rope_scaling,
engine.vision_config), SamplingParams (engine.sampling_params) and RequestOutput (engine.outputs). The rest lives in
subpackages that import one way (tests/test_no_import_cycles.py): processing (prompts into requests, outputs, the
offline batch), multimodal (image prompts, the encoder cache), loop, core, worker, sample, model, layers, text,
loading, quant, kernels.
docs/architecture.md is the map: a step's, a shard's and a weight's path through them.

Imports only torch and its own small deps (gguf, transformers' tokenizer); knows nothing of Parquet, S3 or Dask.

NOTE: the names below load on first use (PEP 562), so `import engine.loading.object_store` (pipeline/, the CLI's
`status`) does not pay for torch (~2 s); `from engine import LLMEngine` still works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine, Prompt
    from engine.outputs import RequestOutput
    from engine.rope_scaling import RopeScaling
    from engine.sampling_params import SamplingParams, StructuredOutputsParams
    from engine.vision_config import VisionConfig

_EXPORTS = {"EngineConfig": "engine.engine_config", "ModelConfig": "engine.config", "LLMEngine": "engine.llm_engine",
            "Prompt": "engine.llm_engine", "RequestOutput": "engine.outputs", "RopeScaling": "engine.rope_scaling",
            "SamplingParams": "engine.sampling_params", "StructuredOutputsParams": "engine.sampling_params",
            "VisionConfig": "engine.vision_config"}

__all__ = ["EngineConfig", "LLMEngine", "ModelConfig", "Prompt", "RequestOutput", "RopeScaling", "SamplingParams",
           "StructuredOutputsParams", "VisionConfig"]


def __getattr__(name: str) -> Any:
    """Import `name`'s module on first use (PEP 562); AttributeError for a name the package does not export."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
