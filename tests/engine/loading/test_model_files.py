"""Models at fsspec URLs and hub ids (engine.loading.model_files): a model folder and a GGUF file on a (moto) S3 load
and
generate exactly as from their local paths; the copy is made once, atomically, keyed by the objects' ETags,
resumed after a SIGKILL mid-copy and never half-used; a hub id resolves through a local HF cache only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from hub_cache import write_hub_cache
from s3_faults import FlakyS3, GetCounter, flaky_s3, upload_folder

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loading.model_files import (
    MODELS_DIR,
    fetch_model,
    is_hub_id,
    list_model_objects,
    model_cache_key,
    resolve_model_path,
)
from engine.loading.open_model import model_name
from engine.text.tokenizer import _gguf_tokenizer_cache

ROOT = Path(__file__).resolve().parents[3]
CPU = EngineConfig(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def s3() -> Iterator[FlakyS3]:
    """A moto S3 (no faults) whose GETs are counted (`s3.faults.delay`, a GetCounter)."""
    with flaky_s3(rate=0.0, lost_rate=0.0) as s3:
        s3.faults.delay = GetCounter()
        yield s3


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _copies(cache: Path) -> list[str]:
    """The entries of the model cache, lock files left out."""
    models = cache / MODELS_DIR
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) if models.exists() else []


def _greedy(engine: LLMEngine, prompts: list[str], n: int = 8) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [list(o.output_token_ids) for o in outs]


def test_model_folder_at_s3_url_loads_once_and_generates_as_local(
        s3: FlakyS3, tiny_model: str, tiny_engine: LLMEngine, gsm8k_questions: list[str], _cache_dir: Path) -> None:
    url = upload_folder(s3.bucket, tiny_model, "models/tiny")
    counter: GetCounter = s3.faults.delay  # type: ignore[assignment]
    engine = LLMEngine.from_model(url, CPU)
    prompts = gsm8k_questions[:2]
    assert _greedy(engine, prompts) == _greedy(tiny_engine, prompts)
    assert engine.model_name == "tiny"  # the copy keeps the URL's name (the accounting's `model`)
    # ... which a shard with no row to run names without loading or copying anything (pipeline.shard_engine)
    assert model_name(url) == model_name(url.rstrip("/") + "/") == "tiny"
    assert model_name(tiny_model.rstrip("/") + "/") == tiny_engine.model_name
    weights = f"{s3.bucket}/models/tiny/model.safetensors"
    assert counter.gets[weights] == 1
    path = resolve_model_path(url)  # a second load on this machine lists the folder and copies nothing
    assert counter.gets[weights] == 1 and _copies(_cache_dir) == [Path(path).parent.name]
    assert sorted(os.listdir(path)) == sorted(os.listdir(tiny_model))


@pytest.mark.slow
def test_gguf_at_s3_url_generates_as_local(s3: FlakyS3, gguf_path: str, real_engine: LLMEngine,
                                           gsm8k_questions: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_WEIGHTS_CACHE", "0")  # no 0.5 GB fp32 cache entry for a copy made for one test
    url = f"s3://{s3.bucket}/gguf/{os.path.basename(gguf_path)}"
    fsspec.filesystem("s3").put_file(gguf_path, url)
    path = resolve_model_path(url)
    assert os.path.basename(path) == os.path.basename(gguf_path) and os.path.getsize(path) == os.path.getsize(gguf_path)
    # Building a tokenizer from a GGUF file takes a minute on 2 busy cores (once per file and machine; its cache is
    # tests/engine/text/test_tokenizer_cache.py's): give the copy the real engine's, so this test times the weights'
    # copy.
    real_engine.tokenizer.hf_tokenizer.save_pretrained(str(_gguf_tokenizer_cache(path)))
    engine = LLMEngine.from_model(url, CPU)
    prompts = gsm8k_questions[4:6]
    assert _greedy(engine, prompts) == _greedy(real_engine, prompts)


def test_a_changed_object_gives_a_new_copy(s3: FlakyS3, tiny_model: str, _cache_dir: Path) -> None:
    url = upload_folder(s3.bucket, tiny_model, "models/changing")
    first = fetch_model(url)
    fs, _, _, objects = list_model_objects(url)
    assert model_cache_key(url, objects) == Path(first).parent.name
    assert model_cache_key(url.rstrip("/"), objects) == Path(first).parent.name  # one URL, one key
    fs.pipe_file(f"{s3.bucket}/models/changing/chat_template.jinja", b"{{ messages }}")  # a new ETag
    second = fetch_model(url)
    assert Path(second).parent.name != Path(first).parent.name
    assert Path(second, "chat_template.jinja").read_bytes() == b"{{ messages }}"
    assert Path(first, "chat_template.jinja").read_bytes() == Path(tiny_model, "chat_template.jinja").read_bytes()
    assert _copies(_cache_dir) == sorted([Path(first).parent.name, Path(second).parent.name])


def test_a_copy_killed_midway_is_never_used_and_the_next_load_resumes(s3: FlakyS3, tiny_model: str,
                                                                      _cache_dir: Path) -> None:
    url = upload_folder(s3.bucket, tiny_model, "models/killed")
    counter: GetCounter = s3.faults.delay  # type: ignore[assignment]
    weights, held = (f"{s3.bucket}/models/killed/{n}" for n in ("model.safetensors", "tokenizer.json"))
    counter.hold, counter.release = {held}, threading.Event()  # objects are copied in name order: weights first
    code = f"from engine.loading.model_files import fetch_model; fetch_model({url!r})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 300  # a hang guard only: the child imports the engine first
        while counter.gets[held] == 0 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)
        assert counter.gets[held] == 1, "the copy never reached tokenizer.json"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        counter.release.set()
        if child.poll() is None:
            child.kill()
    (partial,) = _copies(_cache_dir)
    assert partial.endswith(".partial")  # only the partial folder: nothing a load would take for a model
    assert Path(_cache_dir, MODELS_DIR, partial, "killed", "model.safetensors").is_file()
    path = resolve_model_path(url)
    assert counter.gets[weights] == 1 and counter.gets[held] == 2  # resumed: the whole weights file was kept
    assert _copies(_cache_dir) == [Path(path).parent.name]
    for name in os.listdir(tiny_model):
        assert Path(path, name).read_bytes() == Path(tiny_model, name).read_bytes()
    LLMEngine.from_model(url, CPU)


def test_a_missing_url_is_a_one_line_error(s3: FlakyS3) -> None:
    with pytest.raises(FileNotFoundError, match=r"model URL s3://\S+/nope/ does not exist") as e:
        resolve_model_path(f"s3://{s3.bucket}/nope/")
    assert "\n" not in str(e.value)


def test_a_hub_id_resolves_through_the_local_hf_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            tiny_model: str, tiny_engine: LLMEngine,
                                                            gsm8k_questions: list[str]) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = write_hub_cache(tmp_path / "hf", "tokenmill/tiny-smollm2", tiny_model)
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("tokenmill/tiny-smollm2") and not is_hub_id("hf") and not is_hub_id("s3://a/b")
    assert resolve_model_path("tokenmill/tiny-smollm2") == snapshot
    engine = LLMEngine.from_model("tokenmill/tiny-smollm2", CPU)
    assert _greedy(engine, gsm8k_questions[:2]) == _greedy(tiny_engine, gsm8k_questions[:2])
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("tokenmill/not-here")
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / "hf" / "hub") in message and "hf download" in message
    Path(tmp_path, "tokenmill", "not-here").mkdir(parents=True)  # a local path of that name wins over the hub id
    assert not is_hub_id("tokenmill/not-here") and resolve_model_path("tokenmill/not-here") == "tokenmill/not-here"
