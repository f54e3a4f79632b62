"""docs/architecture.md stays a true map: every file it names exists, every `file.py: name` it points at is defined
in that file, and the README's first screen links to it (issue 52: a newcomer finds the step's, the shard's and the
weight's paths from there)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("engine", "pipeline", "jobs", "schemas")
# `engine/llm_engine.py`, `pipeline/shard.py: run_shard`, `gguf_config.py` (a file named alone), `X.py: A.b`
REFERENCE = re.compile(r"`((?:[\w]+/)*\w+\.py)(?::\s+(\w+)(?:\.(\w+))?)?")


def references(text: str) -> list[tuple[str, str | None, str | None]]:
    """(path, name, attribute) of every file reference in `text` (name and attribute None when not given)."""
    flat = " ".join(text.split())
    return [(m[1], m[2], m[3]) for m in REFERENCE.finditer(flat)]


def defines(source: str, name: str) -> bool:
    """Whether `source` defines `name` at any level: a def, a class or an assignment."""
    return re.search(rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]", source, re.M) is not None


def test_the_map_names_files_and_functions_that_exist() -> None:
    refs = references(DOC.read_text())
    assert len(refs) > 40  # the parse saw the doc
    files = {p.name: p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    missing = []
    for path, name, attr in refs:
        file = ROOT / path if "/" in path else files.get(path)
        if file is None or not file.is_file():
            missing.append(path)
            continue
        source = file.read_text()
        missing += [f"{path}: {n}" for n in (name, attr) if n is not None and not defines(source, n)]
    assert missing == [], f"docs/architecture.md names what the code no longer has: {missing}"


def test_the_readme_first_screen_links_the_map() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:15])
    assert "(docs/architecture.md)" in first_screen


def test_references_parse_names_across_line_breaks() -> None:
    text = "see `engine/loop/engine_loop.py:\nEngineLoop._serve` and `gguf_config.py`"
    assert references(text) == [("engine/loop/engine_loop.py", "EngineLoop", "_serve"), ("gguf_config.py", None, None)]
