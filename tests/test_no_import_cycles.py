"""No import cycles among tokenmill's modules (engine, pipeline, jobs, schemas), none among the engine's subpackages,
and the layers: jobs -> pipeline -> engine, every package -> schemas, nothing back up.

The graph is read from the source with the standard library's `ast`, not by importing anything: one node per module
(a package's __init__.py is the package), an edge for every `import` and `from ... import` of another module of
these packages, absolute or relative, at the top of a file or inside a function (a lazy import only hides a cycle
until the first call; issue 19). `from pkg import name` points at pkg.name when that is a module, else at pkg.
Importing a.b.c also runs a/__init__.py and a/b/__init__.py: those implicit edges are in the graph too (an
__init__ that imports its modules eagerly closes a cycle through any module that imports a sibling package), except
to the importer's own packages, which Python has always run first. Imports under `if TYPE_CHECKING:` count too: they
never run, but they are a dependency all the same, and a cycle hidden behind one is still a cycle of design (issue 41:
engine_loop <-> submission was one).

The engine's rooms (engine/core, loop, text, worker, sample, model, layers, kernels, loading, quant) depend on each
other one way as well: in the package graph (engine.X -> engine.Y when any module of X imports one of Y; each module at
engine/'s top is a node of its own) no two import each other, directly or around a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "pipeline", "jobs", "schemas")


def module_name(path: Path, root: Path) -> str:
    """Dotted module name of a .py file under `root` ("engine/quant/__init__.py" -> "engine.quant")."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) in `tree`: imports that never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def import_graph(root: Path, packages: tuple[str, ...], type_checking: bool = True) -> dict[str, set[str]]:
    """{module: modules of `packages` it imports} for every .py file under root/<package>, per the module docstring;
    the imports under `if TYPE_CHECKING:` too unless `type_checking` is False. Raises SyntaxError naming the file
    when one does not parse."""
    files = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = set() if type_checking else _type_checking_nodes(tree)
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}  # name and its packages
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:  # `import engine.ptq.gptq as g` names the module itself;
                    target = target.rpartition(".")[0]  # a dotted attribute path falls back to its module
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # a.b.c runs a/__init__.py and a/b/__init__.py first
                    step = ".".join(parts[:i])
                    if step in files and step not in own:
                        graph[name].add(step)
    return graph


# Each package may import itself and those after it here: jobs -> pipeline -> engine -> schemas.
LAYERS = ("jobs", "pipeline", "engine", "schemas")


def layer_violations(graph: dict[str, set[str]], layers: tuple[str, ...] = LAYERS) -> list[str]:
    """"a -> b" for every edge of `graph` from a package to one before it in `layers` (an import up the layers)."""
    rank = {pkg: i for i, pkg in enumerate(layers)}
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if rank[b.split(".")[0]] < rank[a.split(".")[0]])


def package_graph(graph: dict[str, set[str]], package: str = "engine") -> dict[str, set[str]]:
    """The graph of `package`'s direct subpackages and top-level modules ("engine.core", "engine.llm_engine"):
    X -> Y when a module in X imports one in Y (X != Y). The package's own __init__ and other packages are left
    out."""
    def room(module: str) -> str | None:
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] == package and len(parts) > 1 else None

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        ra = room(a)
        if ra is None:
            continue
        out.setdefault(ra, set()).update(rb for rb in map(room, targets) if rb is not None and rb != ra)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [m0, m1, ..., m0] (each imports the next), or None when the graph has none."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_tokenmill_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 50 and "engine.ptq.gptq" in graph["engine.ptq.quantize"]  # the walk saw the code
    assert "engine.loop.engine_loop" in graph["pipeline.shard"]  # a TYPE_CHECKING import is in the graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_engine_subpackages_import_one_way() -> None:
    rooms = package_graph(import_graph(ROOT, PACKAGES))
    assert {"engine.core", "engine.loop", "engine.quant", "engine.loading", "engine.llm_engine"} <= set(rooms)
    assert "engine.core" in rooms["engine.loop"]  # the walk saw the code
    cycle = find_cycle(rooms)
    assert cycle is None, "engine subpackages in a circle: " + " -> ".join(cycle or [])


def test_the_engine_top_level_holds_its_public_api_only() -> None:
    # The front door (engine/__init__.py exports each name from its module): everything else is in a subpackage.
    import engine

    top = {p.stem for p in (ROOT / "engine").glob("*.py")} - {"__init__"}
    assert top == {"config", "engine_config", "llm_engine", "outputs", "rope_scaling", "sampling_params",
                   "vision_config"}
    assert {module.rpartition(".")[2] for module in engine._EXPORTS.values()} == top


def test_the_layers_point_one_way() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert "pipeline.storage" in graph["jobs.runner"] and "engine.loading.object_store" in graph["pipeline.storage"]
    assert layer_violations(graph) == []


def test_finds_an_import_up_the_layers_and_a_cycle_through_an_init(tmp_path: Path) -> None:
    for pkg, body in (("jobs", ""), ("pipeline", ""), ("engine", "from engine import model\n"), ("schemas", "")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(body)
    (tmp_path / "engine" / "model.py").write_text("from engine.util import f\n")
    (tmp_path / "engine" / "util.py").write_text("def f():\n    import schemas.arrow\n")
    (tmp_path / "schemas" / "arrow.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                   "    import pipeline.shard\n")
    (tmp_path / "pipeline" / "shard.py").write_text("import engine.model\n")
    graph = import_graph(tmp_path, PACKAGES)
    assert layer_violations(graph) == ["schemas.arrow -> pipeline", "schemas.arrow -> pipeline.shard"]
    # engine.model -> engine.util -> schemas -> schemas.arrow -> pipeline.shard -> engine (its __init__) -> model,
    # the step to pipeline.shard under TYPE_CHECKING: it never runs, and it is a cycle all the same
    cycle = ["engine", "engine.model", "engine.util", "schemas.arrow", "pipeline.shard", "engine"]
    assert find_cycle(graph) == cycle
    assert find_cycle(import_graph(tmp_path, PACKAGES, type_checking=False)) is None
    (tmp_path / "schemas" / "arrow.py").write_text("import pipeline.shard\n")
    assert find_cycle(import_graph(tmp_path, PACKAGES, type_checking=False)) == cycle


def test_finds_two_subpackages_in_a_circle(tmp_path: Path) -> None:
    eng = tmp_path / "engine"
    for sub in ("loading", "quant", "model"):
        (eng / sub).mkdir(parents=True)
        (eng / sub / "__init__.py").write_text("")
    (eng / "__init__.py").write_text("")
    (eng / "top.py").write_text("import engine.loading.reader\n")
    (eng / "loading" / "reader.py").write_text("from engine.quant.state import LM_HEAD\nfrom engine.model import x\n")
    (eng / "quant" / "state.py").write_text("LM_HEAD = 'lm_head'\n")
    (eng / "model" / "x.py").write_text("")
    # No module cycle (quant.handler imports loading.fill, which imports nothing of quant), but the rooms circle.
    (eng / "quant" / "handler.py").write_text("from engine.loading.fill import fill\n")
    (eng / "loading" / "fill.py").write_text("def fill():\n    pass\n")
    graph = import_graph(tmp_path, ("engine",))
    assert find_cycle(graph) is None
    rooms = package_graph(graph)
    assert rooms == {"engine.top": {"engine.loading"}, "engine.loading": {"engine.quant", "engine.model"},
                     "engine.quant": {"engine.loading"}, "engine.model": set()}
    assert find_cycle(rooms) == ["engine.loading", "engine.quant", "engine.loading"]
    (eng / "loading" / "fill.py").unlink()  # the fill moves to the room both import (as engine.model.fill did)
    (eng / "model" / "fill.py").write_text("def fill():\n    pass\n")
    (eng / "quant" / "handler.py").write_text("from engine.model.fill import fill\n")
    assert find_cycle(package_graph(import_graph(tmp_path, ("engine",)))) is None


def test_finds_a_cycle_through_a_lazy_relative_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import f\n")
    (pkg / "a.py").write_text("import pkg.sub.b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n    return g\n")
    (pkg / "c.py").write_text("from pkg import a\n\ndef g():\n    return 1\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.b"}, "pkg.a": {"pkg.sub", "pkg.sub.b"}, "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None
