"""tokenmill's LLM engine: a Llama-family decoder over a paged KV cache with continuous batching.

Imports only torch and its own small deps (gguf, transformers' tokenizer); knows nothing of Parquet, S3 or Dask.
"""

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["EngineConfig", "LLMEngine", "ModelConfig", "Prompt", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
