"""Model files to weights: GGUF, Hugging Face and tokenmill folders, local or object-store URLs, the weights cache,
quantized loading and named random-weight presets.

NOTE: imports nothing itself; import the modules.
"""
