"""What test_triton_attention.py and test_triton_fused.py share: the skip when no Triton backend can run their kernels,
and the sm_90 (H100/H200) compile check in a fresh process without TRITON_INTERPRET (the interpreter checks no types,
loop-carried values, tl.dot shapes, constexpr use or shared memory, the compiler does, and triton ships ptxas, so no
GPU is needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def skip_without_a_backend(kernels_module: str, kernel: str) -> None:
    """Skip the test unless its kernels can run: on CUDA, or interpreted under TRITON_INTERPRET=1 (and then only if
    `kernels_module` was not imported, i.e. compiled, before the variable was set in this process; `kernel` is one of
    its kernels)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpret and not torch.cuda.is_available():
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")
    module = sys.modules.get(kernels_module)
    if interpret and module is not None and type(getattr(module, kernel)).__name__ != "InterpretedFunction":
        pytest.skip("triton kernels were compiled before TRITON_INTERPRET=1 was set in this process")


#: Put before a test's script: `compile_kernel(fn, types, constexprs, **options)` compiles one specialization
#: (parameters not in `types` or `constexprs` are i32; options such as num_warps over the script's defaults) and exits
#: non-zero past the 227 KiB of shared memory an sm_90 block may have.
PRELUDE = """
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_kernel(fn, types, constexprs, **options):
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**DEFAULT_OPTIONS, **options})
    if compiled.metadata.shared > 227 * 1024:
        sys.exit(f"{fn.fn.__name__}: {compiled.metadata.shared} bytes of shared memory")
"""


def compile_for_sm90(script: str, options: dict[str, int], env: dict[str, str] | None = None) -> None:
    """Run PRELUDE + `script` (which ends by printing "compiled") in a fresh Python at the repository root, with
    `options` the compile options of every kernel (num_warps, num_stages) and `env` added to the environment; fails
    the test with the compiler's error, skips where triton cannot target NVIDIA GPUs."""
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backends registry")
    if "nvidia" not in backends:
        pytest.skip("triton was built without the NVIDIA backend")
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    root = Path(__file__).resolve().parents[2]
    prelude = f"DEFAULT_OPTIONS = {options!r}\n" + PRELUDE
    proc = subprocess.run([sys.executable, "-c", prelude + script], cwd=root, env=full_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
