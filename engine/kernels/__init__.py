"""Kernels: the C++ CPU kernels (csrc/) and their loader, the Triton kernels, GGUF blocks for small CPU batches.

NOTE: imports nothing itself; import the modules.
"""
