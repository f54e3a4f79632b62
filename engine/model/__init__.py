"""The decoder: one model class for every family (the architecture registry says how a family differs), its tensor
names, whole-sequence forward passes and perplexity.

NOTE: imports nothing itself; import the modules.
"""
