"""The decoder's layers: paged attention (torch, C++ and Triton backends), RoPE, RMSNorm.

NOTE: imports nothing itself; import the modules.
"""
