"""Fixtures of the C++ kernel tests."""

from __future__ import annotations

from types import ModuleType

import pytest

from engine.kernels.cpu_kernels import cpu_ops


@pytest.fixture(scope="module")
def encoder_ops() -> ModuleType:
    """The C++ kernels with their encoder kernels (encoder_kernels.cpp: built for AVX2 + FMA, so on both CPU kinds of
    CI); a failure when the kernels do not build (g++ and ninja are test dependencies)."""
    built = cpu_ops()
    if built is None:
        pytest.fail("the CPU kernels did not build (g++ and ninja are test dependencies); see the warning above")
    if not built.encoder_attention_available():
        pytest.skip("the kernels were built for a CPU without AVX2 + FMA: the encoder kernels are not in them")
    return built
