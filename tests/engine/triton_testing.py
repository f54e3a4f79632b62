"""What test_triton_attention.py and test_triton_fused.py share: the skip when no Triton backend can run their kernels,
and the sm_90 (H100/H200) compile check in a fresh process without TRITON_INTERPRET (the interpreter checks no types,
loop-carried values, tl.dot shapes, constexpr use or shared memory, the compiler does, and triton ships ptxas, so no
GPU is needed). A compile that passed is recorded in the repository (sm90_compiled/NAME.sha256 beside this file: the
hash of everything it depends on, compiled_digest), so a clone runs it again only when a kernel's source, the script,
its options or triton change: the check costs minutes of CPU once, on the machine that changed the kernel (which
commits the new record with the change), not on every fresh clone or CI run."""

from __future__ import annotations

import hashlib
import os
import re
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


ROOT = Path(__file__).resolve().parents[2]
_ENGINE_IMPORT = re.compile(r"^\s*from (engine(?:\.\w+)*) import ([\w, ]+)", re.MULTILINE)


def engine_sources(text: str, seen: set[Path] | None = None) -> set[Path]:
    """The engine/ source files `text` imports with `from engine... import ...`, and those they import the same way
    (a module or a package's __init__ for each name)."""
    seen = set() if seen is None else seen
    for package, names in _ENGINE_IMPORT.findall(text):
        base = ROOT / package.replace(".", "/")
        candidates = [base / f"{n.strip().split(' ')[0]}.py" for n in names.split(",")] + [
            base.with_suffix(".py"), base / "__init__.py"]
        for path in candidates:
            if path.is_file() and path not in seen:
                seen.add(path)
                engine_sources(path.read_text(), seen)
    return seen


#: Where passed compiles are recorded: one file per check, the compiled_digest of its last passed compile.
STAMPS = Path(__file__).resolve().parent / "sm90_compiled"


def compiled_digest(script: str, options: dict[str, int], env: dict[str, str] | None = None) -> str:
    """The SHA-256 (hex) of a compile check: the script, PRELUDE, the options, `env`, triton's version and the engine
    sources the script imports (engine_sources, by their paths relative to the repository and their bytes)."""
    import triton

    digest = hashlib.sha256()
    for part in (PRELUDE, script, repr(sorted(options.items())), repr(sorted((env or {}).items())),
                 triton.__version__):
        digest.update(part.encode() + b"\0")
    for path in sorted(engine_sources(script)):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def compile_for_sm90(name: str, script: str, options: dict[str, int], env: dict[str, str] | None = None) -> None:
    """Run PRELUDE + `script` (which ends by printing "compiled") in a fresh Python at the repository root, with
    `options` the compile options of every kernel (num_warps, num_stages) and `env` added to the environment; fails
    the test with the compiler's error, skips where triton cannot target NVIDIA GPUs. Nothing runs when the same
    compile passed before (STAMPS/`name`.sha256 holds its compiled_digest: same kernel sources, script, options and
    triton); a pass writes that record, to be committed with the kernel change that made it."""
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no backends registry")
    if "nvidia" not in backends:
        pytest.skip("triton was built without the NVIDIA backend")
    digest = compiled_digest(script, options, env)
    import triton

    stamp = STAMPS / f"{name}.sha256"
    if stamp.is_file() and stamp.read_text().split()[:1] == [digest]:
        return
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    prelude = f"DEFAULT_OPTIONS = {options!r}\n" + PRELUDE
    proc = subprocess.run([sys.executable, "-c", prelude + script], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(f"{digest}  triton {triton.__version__}, passed the compile of {name}'s kernels for sm_90\n")
