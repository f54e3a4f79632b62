"""What runs a step on a device: the model runner, the persistent input batch, CUDA graphs, device and dtype probing.

NOTE: imports nothing itself; import the modules.
"""
