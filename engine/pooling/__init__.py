"""Embeddings: a model's last hidden states pooled into one vector per text, as the model's own
sentence-transformers files say (engine.pooling.st_config: modules.json, 1_Pooling/config.json, Normalize,
sentence_bert_config.json), with the rows batched by a token budget (engine.pooling.embedder). The public way in is
engine.LLMEngine.embed.

Design after vLLM's pooling models (vllm/model_executor/layers/pooler.py: a pooler apart from the model, reading the
sentence-transformers config; the model's `forward` only gives hidden states), written for tokenmill's packed rows.
"""
