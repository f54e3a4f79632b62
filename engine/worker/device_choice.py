"""The engine's automatic device and dtype as one rule over what the machine offers, without torch: the engine
(engine.worker.device, asking torch's CUDA and bf16 probes) and the client's checks before a job (jobs.plan.model_fit,
jobs.plan.preflight: nvidia-smi and /proc/cpuinfo, in a process that never imports torch; issue 31) both choose
through it, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable


def choose_device(device: str, cuda_available: Callable[[], object]) -> str:
    """The name of the device `device` runs on: "auto" is "cuda" when `cuda_available()` is true, else "cpu"; an
    explicit name as given ("cuda:1"). Raises ValueError when a CUDA device is asked for and `cuda_available()` is
    false."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device.partition(":")[0] == "cuda" and not cuda_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available; use --device cpu")
    return device


def choose_dtype(dtype: str, device_type: str, native_bf16: Callable[[], bool]) -> str:
    """The name of the dtype `dtype` runs in on a device of type `device_type` ("cpu", "cuda"): an explicit name as
    given; "auto" is bfloat16 on CUDA and on a CPU that computes bf16 natively (`native_bf16()`), else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device_type == "cuda" or (device_type == "cpu" and native_bf16()) else "float32"
