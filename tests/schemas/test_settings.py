"""TOKENMILL_* environment variables (and TRITON_INTERPRET): read through schemas.settings only, and when asked,
never at import."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from schemas import settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "pipeline", "jobs", "schemas")
NAME = re.compile(r"^(TOKENMILL_[A-Z0-9_]+|TRITON_INTERPRET)$")


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
            for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def test_only_the_settings_module_names_a_tokenmill_variable() -> None:
    """A TOKENMILL_* name (or TRITON_INTERPRET) as a string is in schemas/settings.py, or a job option's `envvar`
    (read by the CLI's option parser); nowhere else can a module read one past the settings."""
    found = []
    for path, tree in _sources().items():
        if path == "schemas/settings.py":
            continue
        envvars = {id(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                   for k in node.keywords if k.arg == "envvar"}
        found += [f"{path}:{n.lineno} {n.value}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.match(n.value)
                  and id(n) not in envvars]
    assert found == []


def test_the_settings_list_every_variable_infra_reads() -> None:
    """Every TOKENMILL_* variable infra/'s files name (the Airflow DAG, the cron script, the Kubernetes manifests,
    the Dockerfile) is a constant of schemas/settings.py or a job option's `envvar`: the settings' list is whole."""
    listed = {v for k, v in vars(settings).items() if k.isupper() and isinstance(v, str) and NAME.match(v)}
    options = {k.value.value for tree in _sources().values() for node in ast.walk(tree) if isinstance(node, ast.Call)
               for k in node.keywords if k.arg == "envvar" and isinstance(k.value, ast.Constant)}
    named = {m for p in sorted((ROOT / "infra").rglob("*")) if p.is_file() and p.suffix != ".png"
             for m in re.findall(r"TOKENMILL_[A-Z0-9_]+", p.read_text(errors="replace"))}
    assert {"TOKENMILL_JOB_SPEC", "TOKENMILL_WORKER_WAIT_S"} <= named  # the walk saw the DAG
    assert sorted(named - listed - options) == []


def test_no_module_reads_the_environment_when_imported() -> None:
    """No call at a module's top level (or in a class body, which runs at import too) reads os.environ, os.getenv
    or a setting: a variable set after the import (a test, a Dask worker's plugin) would be ignored."""
    def reads_env(node: ast.AST) -> bool:
        text = ast.unparse(node)
        return "environ" in text or "getenv" in text or "settings.env_" in text or "settings.cache_dir" in text

    def top_level(body: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(stmt, ast.ClassDef):
                out += top_level(stmt.body)
            else:
                out.append(stmt)
        return out

    found = [f"{path}:{stmt.lineno}" for path, tree in _sources().items() for stmt in top_level(tree.body)
             if any(isinstance(n, ast.Call) and reads_env(n.func) for n in ast.walk(stmt))
             or any(isinstance(n, ast.Subscript) and reads_env(n.value) for n in ast.walk(stmt))]
    assert found == []


def test_switches_and_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.GGUF_KERNEL, raising=False)
    assert settings.env_flag(settings.GGUF_KERNEL) is True
    for raw, on in (("0", False), ("off", False), ("FALSE", False), ("1", True), ("yes", True), (" ", True)):
        monkeypatch.setenv(settings.GGUF_KERNEL, raw)
        assert settings.env_flag(settings.GGUF_KERNEL) is on  # read now: set after import, seen
    monkeypatch.setenv(settings.GGUF_KERNEL, "maybe")
    with pytest.raises(ValueError, match="TOKENMILL_GGUF_KERNEL must be 1 or 0 .on or off., got 'maybe'"):
        settings.env_flag(settings.GGUF_KERNEL)
    monkeypatch.setenv(settings.LEASE_TTL_S, "2.5")
    assert settings.env_seconds(settings.LEASE_TTL_S, 60.0) == 2.5
    monkeypatch.setenv(settings.LEASE_TTL_S, "0")
    with pytest.raises(ValueError, match="TOKENMILL_LEASE_TTL_S must be > 0 seconds, got '0'"):
        settings.env_seconds(settings.LEASE_TTL_S, 60.0)
    assert settings.env_seconds(settings.LEASE_TTL_S, 60.0, allow_zero=True) == 0.0
    monkeypatch.setenv(settings.CACHE_DIR, "/tmp/tm-cache")
    assert settings.cache_dir() == Path("/tmp/tm-cache")
    monkeypatch.delenv(settings.CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/xdg")
    assert settings.cache_dir() == Path("/tmp/xdg/tokenmill")


def test_triton_interpret_is_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.TRITON_INTERPRET, raising=False)
    assert settings.triton_interpret() is False
    monkeypatch.setenv(settings.TRITON_INTERPRET, "1")
    assert settings.triton_interpret() is True
    monkeypatch.setenv(settings.TRITON_INTERPRET, "0")
    assert settings.triton_interpret() is False
