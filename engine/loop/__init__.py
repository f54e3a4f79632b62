"""The engine loop: one thread stepping an LLMEngine for several submitters (shards), and the submissions it serves.

NOTE: imports nothing itself; import the modules.
"""
