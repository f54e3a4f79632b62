"""What tests/bench/test_gpu_session.py reads of bench/gpu_session.sh and bench/gpu_prepare.sh: the steps the script
defines, its header's plan of device calls, a dry run of the script here (a stand-in python3 records each command
line as bash expanded it, so the arguments are exactly the device's), and the third-party modules a set of source
files imports (followed through the repository's own modules), to hold against what the device has."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_session.sh"
PREPARE = ROOT / "bench" / "gpu_prepare.sh"
IMAGE = ROOT / "bench" / "gpu_image_packages.txt"
REPO_PACKAGES = ("engine", "pipeline", "jobs", "schemas", "bench")
_STEP = re.compile(r"^step (\w+) (\d+) ", re.MULTILINE)
_RUN = re.compile(r'run\(command="(?P<command>[^"]*)",\s*carry=\[(?P<carry>[^\]]*)\],\s*timeout_s=(?P<timeout>\d+)\)')


def defined_steps() -> dict[str, int]:
    """{step name: its time limit in seconds} from the script's `step NAME SECONDS COMMAND...` lines."""
    return {name: int(limit) for name, limit in _STEP.findall(SCRIPT.read_text())}


def header() -> str:
    """The script's leading comment block, without the '#' marks; a line ending in a backslash joined to the next."""
    lines = []
    for line in SCRIPT.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return re.sub(r"\\\n\s*", "", "\n".join(lines))


def script_body() -> str:
    """The script after its header: the part bash runs."""
    return SCRIPT.read_text().split("\nset -uo pipefail\n", 1)[1]


@dataclass(frozen=True)
class DeviceCall:
    """One run() of the header's plan: the variables set before `bash bench/gpu_session.sh`, the carried paths and
    the call's timeout_s."""

    env: dict[str, str]
    carry: tuple[str, ...]
    timeout_s: int

    @property
    def steps(self) -> list[str]:
        return self.env.get("STEPS", "").split()


def planned_calls() -> list[DeviceCall]:
    """The header's run(command=..., carry=[...], timeout_s=N) calls, in order. Raises ValueError for a command that
    is not `NAME=value ... bash bench/gpu_session.sh`."""
    calls = []
    for m in _RUN.finditer(header()):
        words = shlex.split(m["command"])
        if words[-2:] != ["bash", "bench/gpu_session.sh"] or not all("=" in w for w in words[:-2]):
            raise ValueError(f"a planned call is not 'NAME=value ... bash bench/gpu_session.sh': {m['command']}")
        env = dict(w.split("=", 1) for w in words[:-2])
        carry = tuple(c.strip().strip('"') for c in m["carry"].split(",") if c.strip())
        calls.append(DeviceCall(env, carry, int(m["timeout"])))
    return calls


def carried_wheels() -> list[str]:
    """The distributions bench/gpu_prepare.sh puts in .gpu_w (its WHEELS and BUILT arrays), without versions."""
    text = PREPARE.read_text()
    names = []
    for array in ("WHEELS", "BUILT"):
        body = re.search(rf"^{array}=\((.*?)^\)", text, re.MULTILINE | re.DOTALL)
        if body is None:
            raise ValueError(f"bench/gpu_prepare.sh has no {array}=( ... ) array")
        names += [re.split(r"[=<>]", w)[0] for w in body[1].split()]
    return names


def image_packages() -> list[str]:
    """The distributions of the device image (bench/gpu_image_packages.txt)."""
    return [line.strip() for line in IMAGE.read_text().splitlines() if line.strip() and not line.startswith("#")]


def dry_run(tmp: Path, env: dict[str, str]) -> tuple[dict[str, list[dict]], str]:
    """Run the script here in the empty folder `tmp` (so no .gpu* folder and no /tmp/site is touched), with `env`
    added, a python3 that prints {"argv", "env" (its TOKENMILL_* variables)} as a JSON line and exits 0, and an
    nvidia-smi that prints a name. Returns ({step: its python3 calls, from the logs in $OUT/logs.tgz}, the output)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        f"#!{sys.executable} -S\nimport json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'env': {k: v for k, v in os.environ.items() "
        "if k.startswith('TOKENMILL_')}}))\n")
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'stand-in GPU, 0 MiB'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp / "out"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "TMPDIR": str(tmp), **env}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp, env=full_env, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"the dry run exited {proc.returncode}:\n{output}")
    logs = tmp / "logs"
    with tarfile.open(out / "logs.tgz") as tar:
        tar.extractall(logs, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    calls = {}
    for log in logs.glob("*.log"):
        calls[log.stem] = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return calls, output


class _Imports(ast.NodeVisitor):
    """The imports of one module: (dotted name, optional), optional when inside a try that catches ImportError (or
    any Exception); `if TYPE_CHECKING:` blocks are left out; `from a import b` also yields a.b (b may be a module)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.found: list[tuple[str, bool]] = []
        self._optional = 0

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        caught = " ".join(ast.unparse(h.type) if h.type else "Exception" for h in node.handlers)
        optional = any(name in caught for name in ("ImportError", "ModuleNotFoundError", "Exception"))
        self._optional += optional
        for child in node.body:
            self.visit(child)
        self._optional -= optional
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(a.name, self._optional > 0) for a in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.module.split(".")
            parent = parts[:len(parts) - node.level + (1 if self.is_package else 0)]
            base = ".".join(parent + ([node.module] if node.module else []))
        self.found.append((base, self._optional > 0))
        self.found += [(f"{base}.{a.name}", True) for a in node.names]  # a module or just a name: never required


def _module_file(name: str, helper_dirs: list[Path]) -> Path | None:
    parts = name.split(".")
    if parts[0] not in REPO_PACKAGES:
        hits = [d / f"{name}.py" for d in helper_dirs if len(parts) == 1 and (d / f"{name}.py").is_file()]
        return hits[0] if hits else None
    base = ROOT.joinpath(*parts)
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def third_party_imports(entries: list[Path], snippets: list[str] = ()) -> dict[str, list[str]]:
    """{top-level module: the files that need it} for every module `entries` (and the code `snippets`) import,
    followed through the repository's packages and the tests' helper modules (function-level imports included:
    they run when the step does). Standard library and optional imports (under try/except ImportError) are left
    out."""
    helper_dirs = sorted({p.parent for p in entries} | {ROOT / "tests", ROOT / "tests" / "engine"})
    needed: dict[str, list[str]] = {}
    queue: list[tuple[str, str]] = [(str(p.relative_to(ROOT)), p.read_text()) for p in entries]
    queue += [(f"<python3 -c #{i}>", code) for i, code in enumerate(snippets)]
    seen = {where for where, _ in queue}
    while queue:
        where, text = queue.pop()
        module = where[:-3].replace("/", ".").removesuffix(".__init__") if where.endswith(".py") else "__main__"
        visitor = _Imports(module, where.endswith("__init__.py"))
        visitor.visit(ast.parse(text))
        for name, optional in visitor.found:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # the package __init__ files on the way in, then the module
                path = _module_file(".".join(parts[:i]), helper_dirs)
                if path is not None and str(path.relative_to(ROOT)) not in seen:
                    seen.add(str(path.relative_to(ROOT)))
                    queue.append((str(path.relative_to(ROOT)), path.read_text()))
            top = parts[0]
            if optional or not top or top == "__future__" or top in sys.stdlib_module_names:
                continue
            if top in REPO_PACKAGES or _module_file(top, helper_dirs) is not None:
                continue
            needed.setdefault(top, []).append(where)
    return needed


def conftests(test_file: Path) -> list[Path]:
    """The conftest.py files pytest loads for `test_file`: tests/conftest.py down to its folder's."""
    folders = [test_file.parent, *test_file.parent.parents]
    return [f / "conftest.py" for f in folders if (f / "conftest.py").is_file() and ROOT / "tests" in [f, *f.parents]]
