"""Sampling: the sampler (greedy, temperature, top-p/top-k, seeds), logits processors, penalties, structured output.

NOTE: imports nothing itself; import the modules.
"""
