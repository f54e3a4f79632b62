"""The scheduler's state: requests, the scheduler (continuous batching, chunked prefill, preemption), the KV cache
manager (paged blocks, prefix caching) and per-step statistics. Knows no model, no torch module.

NOTE: imports nothing itself; import the modules.
"""
