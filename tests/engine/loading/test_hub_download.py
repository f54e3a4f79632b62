"""`--model owner/name[@revision]` downloads through huggingface_hub once per machine into the model cache (issue 42),
against a local server that answers as the hub's file API does (tests/hub_server.py): only the files a model needs,
HF_ENDPOINT / HF_TOKEN / HF_HUB_OFFLINE honoured, one download while other processes wait on its lock; offline, the
local caches as before (test_model_files.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer, env_for

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loading.model_files import resolve_model_path

ROOT = Path(__file__).resolve().parents[3]
REPO = "tokenmill/tiny-smollm2"
CPU = EngineConfig(device="cpu", dtype="float32")


@pytest.fixture
def repo(tmp_path: Path, tiny_model: str) -> Path:
    """The tiny model's folder as a hub repo, with files a model does not need beside it (a .bin duplicate, Meta's
    original/ checkpoint), which must not be downloaded."""
    folder = tmp_path / "repo"
    shutil.copytree(tiny_model, folder)
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(b"not read")
    (folder / "original" / "params.json").write_text("{}")
    return folder


@pytest.fixture
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Empty caches (tokenmill's and HF's), online; returns tokenmill's cache root."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cache"


def _greedy(engine: LLMEngine, prompts: list[str]) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


def test_a_hub_id_downloads_once_what_the_model_needs(repo: Path, hub_env: Path, tiny_engine: LLMEngine,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      gsm8k_questions: list[str]) -> None:
    with HubServer({REPO: str(repo)}) as hub:
        for k, v in env_for(hub).items():
            monkeypatch.setenv(k, v)
        path = resolve_model_path(REPO)
        assert Path(path).is_relative_to(hub_env / "models" / "hub")
        wanted = sorted(f for f in hub.files(REPO) if not f.endswith((".bin", ".pth")) and
                        not f.startswith("original/"))
        assert sorted(hub.gets) == wanted and set(hub.gets.values()) == {1}
        assert sorted(os.listdir(path)) == wanted  # no .bin, no original/
        engine = LLMEngine.from_model(REPO, CPU)
        assert _greedy(engine, gsm8k_questions[:2]) == _greedy(tiny_engine, gsm8k_questions[:2])
        assert resolve_model_path(f"{REPO}@main") == path and set(hub.gets.values()) == {1}  # from the cache
        with pytest.raises(FileNotFoundError) as e:
            resolve_model_path(f"{REPO}@v9")
        assert "\n" not in str(e.value) and f"{REPO!r} has no revision 'v9' at {hub.url}" in str(e.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline and the server gone: the model cache still serves it
    assert resolve_model_path(REPO) == path


def test_offline_nothing_is_downloaded(repo: Path, hub_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with HubServer({REPO: str(repo)}) as hub:
        for k, v in env_for(hub).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(FileNotFoundError) as e:
            resolve_model_path(REPO)
        assert "\n" not in str(e.value) and "HF_HUB_OFFLINE is set, so nothing is downloaded" in str(e.value)
        assert not hub.gets


def test_a_private_repo_needs_hf_token(repo: Path, hub_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with HubServer({REPO: str(repo)}, tokens={REPO: "hf_secret"}) as hub:
        for k, v in env_for(hub).items():
            monkeypatch.setenv(k, v)
        with pytest.raises(PermissionError) as e:
            resolve_model_path(REPO)
        assert "\n" not in str(e.value) and "HTTP 401" in str(e.value) and "HF_TOKEN is unset" in str(e.value)
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        assert os.path.isfile(os.path.join(resolve_model_path(REPO), "tokenmill_model.json"))


def test_processes_racing_for_a_hub_id_download_it_once(repo: Path, hub_env: Path) -> None:
    """Two processes resolve the same id at once: one downloads under the lock, the other waits and uses its copy."""
    with HubServer({REPO: str(repo)}) as hub:
        env = {**os.environ, **env_for(hub), "PYTHONPATH": str(ROOT)}
        code = ("import sys; from engine.loading.model_files import resolve_model_path; "
                "print(resolve_model_path(sys.argv[1]))")
        procs = [subprocess.Popen([sys.executable, "-c", code, REPO], env=env, stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
        paths = {p.communicate(timeout=300)[0].strip() for p in procs}
        assert all(p.returncode == 0 for p in procs) and len(paths) == 1
        assert set(hub.gets.values()) == {1} and json.loads(Path(paths.pop(), "tokenmill_model.json").read_text())
