"""No Python file of the repository over MAX_LINES lines, outside engine/kernels/csrc (issue 41: a file that grows past
it is split by role, as engine/model/hf_config.py left architectures.py). The walk reads the working tree, so a new
file counts before it is committed; hidden folders (.git, .venv) and caches are not the project's code."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 350
EXEMPT = (Path("engine/kernels/csrc"),)
SKIPPED_PARTS = {"__pycache__", "node_modules", "build", "dist"}


def oversized(root: Path, max_lines: int = MAX_LINES, exempt: tuple[Path, ...] = EXEMPT) -> dict[str, int]:
    """{path relative to root: its line count} of every .py file under `root` with more than `max_lines` lines,
    leaving out the folders in `exempt` (relative to root), hidden folders and build caches."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p.startswith(".") or p in SKIPPED_PARTS for p in rel.parts[:-1]):
            continue
        if any(rel.is_relative_to(e) for e in exempt):
            continue
        lines = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
        if lines > max_lines:
            out[str(rel)] = lines
    return out


def test_no_python_file_over_the_limit() -> None:
    assert (ROOT / "engine" / "llm_engine.py").is_file()  # the walk sees the code
    big = oversized(ROOT)
    assert big == {}, f"files over {MAX_LINES} lines (split each by role): {big}"


def test_finds_a_long_file_and_skips_csrc_and_hidden_folders(tmp_path: Path) -> None:
    (tmp_path / "engine" / "kernels" / "csrc").mkdir(parents=True)
    (tmp_path / ".venv").mkdir()
    long = "x = 1\n" * (MAX_LINES + 1)
    (tmp_path / "engine" / "big.py").write_text(long)
    (tmp_path / "engine" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "engine" / "kernels" / "csrc" / "gen.py").write_text(long)
    (tmp_path / ".venv" / "lib.py").write_text(long)
    assert oversized(tmp_path) == {str(Path("engine/big.py")): MAX_LINES + 1}
