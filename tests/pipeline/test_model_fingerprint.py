"""The model fingerprint (pipeline.model_pin, issue 26 item 1): a local file's sha256 computed once and cached per
machine, a model folder file by file, an S3 model by its objects' ETags (a real moto server, conftest's s3_bucket),
and the pin committed create-only under OUTPUT."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import fsspec
import pytest

from pipeline.model_pin import (
    ModelChanged,
    ModelPinError,
    check_model_pin,
    file_sha256,
    fingerprint_model,
    hash_cache_entry,
    pin_model,
    read_model_pin,
)


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _flip_tail(path: Path, n: int = 64) -> None:
    """Change the file's last n bytes in place: same name, same size, other bytes."""
    data = bytearray(path.read_bytes())
    data[-n:] = bytes(b ^ 0xFF for b in data[-n:])
    path.write_bytes(bytes(data))


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    return cache


def test_a_file_is_hashed_once_and_the_cache_never_answers_for_other_bytes(gguf_path: str, tmp_path: Path,
                                                                          cache_dir: Path) -> None:
    """The first fingerprint hashes the GGUF and writes the cache entry; the second reads the entry, not the file
    (an entry edited by hand is what it returns). A write that keeps size and restores the mtime still makes a new
    key (ctime), so the new bytes are hashed."""
    model = tmp_path / "model.gguf"
    shutil.copyfile(gguf_path, model)
    real = _sha256(model)
    first = fingerprint_model(str(model))
    assert first.files[0].digest == f"sha256:{real}" and first.files[0].size == model.stat().st_size
    entry = hash_cache_entry(str(model))
    assert entry.parent == cache_dir / "model-hashes"
    assert json.loads(entry.read_text())["sha256"] == real

    # The cached value is what a second fingerprint returns: proof that it did not read the file again.
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "sha256": "0" * 64}))
    assert fingerprint_model(str(model)).files[0].digest == "sha256:" + "0" * 64

    st = model.stat()
    _flip_tail(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))  # same name, size and mtime; other bytes
    assert model.stat().st_mtime_ns == st.st_mtime_ns
    now = fingerprint_model(str(model))
    assert now.files[0].digest == f"sha256:{_sha256(model)}" != first.files[0].digest
    assert file_sha256(str(model)) == _sha256(model)
    change = first.changes(now)
    assert change is not None and "model.gguf was" in change and real[:16] in change


def test_the_same_bytes_at_another_path_are_the_same_model(tiny_model: str, tmp_path: Path, cache_dir: Path) -> None:
    copy = tmp_path / "elsewhere"
    shutil.copytree(tiny_model, copy)
    (copy / "README.md").write_text("notes are not the model")
    a, b = fingerprint_model(tiny_model), fingerprint_model(str(copy))
    assert a.fingerprint == b.fingerprint and a.changes(b) is None
    assert {f.name for f in a.files} >= {"tokenmill_model.json", "model.safetensors", "tokenizer.json"}
    assert "README.md" not in {f.name for f in b.files}


def test_a_folder_changed_in_one_weight_file_is_another_model(tiny_model: str, tmp_path: Path,
                                                             cache_dir: Path) -> None:
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model, copy)
    before = fingerprint_model(str(copy))
    _flip_tail(copy / "model.safetensors")
    after = fingerprint_model(str(copy))
    assert after.fingerprint != before.fingerprint
    with pytest.raises(ModelChanged) as e:
        check_model_pin(before, after, "out/")
    message = str(e.value)
    assert "\n" not in message and "model.safetensors was" in message and "tokenizer.json" not in message
    assert "Restore the model" in message and "new OUTPUT" in message
    (copy / "model.safetensors").unlink()
    with pytest.raises(ModelChanged, match="model.safetensors is gone"):
        check_model_pin(before, fingerprint_model(str(copy)), "out/")


def test_a_missing_model_or_a_folder_without_model_files_is_refused(tmp_path: Path, cache_dir: Path) -> None:
    with pytest.raises(ModelPinError, match="does not exist"):
        fingerprint_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    with pytest.raises(ModelPinError, match="holds no model files"):
        fingerprint_model(str(tmp_path / "empty"))


def test_the_pin_is_create_only(tiny_model: str, tmp_path: Path, cache_dir: Path) -> None:
    out = str(tmp_path / "out")
    assert read_model_pin(out) is None
    pin = fingerprint_model(tiny_model)
    pinned, created = pin_model(out, pin)
    assert created and pinned == pin and read_model_pin(out) == pin
    committed = (tmp_path / "out" / "_manifest" / "model.json").read_bytes()
    copy = tmp_path / "tiny"
    shutil.copytree(tiny_model, copy)
    _flip_tail(copy / "tokenizer.json", 8)
    with pytest.raises(ModelChanged, match="tokenizer.json was"):
        pin_model(out, fingerprint_model(str(copy)))
    assert (tmp_path / "out" / "_manifest" / "model.json").read_bytes() == committed  # never overwritten


def test_an_s3_model_is_fingerprinted_by_its_etags(s3_bucket: str, tiny_model: str, tmp_path: Path,
                                                   cache_dir: Path) -> None:
    """A model folder under an S3 prefix: each model object's size and ETag (S3's MD5 of a single-part upload), read
    from the store (nothing lands in the hash cache: nothing was downloaded); an object overwritten with other bytes
    of the same size is another model. A single object is fingerprinted the same way."""
    s3 = fsspec.filesystem("s3", skip_instance_cache=True)
    for f in Path(tiny_model).iterdir():
        s3.put_file(str(f), f"{s3_bucket}/models/tiny/{f.name}")
    pin = fingerprint_model(f"s3://{s3_bucket}/models/tiny")
    local = fingerprint_model(tiny_model)
    assert {f.name: f.size for f in pin.files} == {f.name: f.size for f in local.files}
    by_name = {f.name: f for f in pin.files}
    weights = Path(tiny_model, "model.safetensors").read_bytes()
    assert by_name["model.safetensors"].digest == f"etag:{hashlib.md5(weights).hexdigest()}"
    assert not (cache_dir / "model-hashes").exists() or len(list((cache_dir / "model-hashes").iterdir())) == len(
        local.files)  # only the local folder's files were hashed

    changed = bytearray(weights)
    changed[-16:] = bytes(b ^ 0xFF for b in changed[-16:])
    s3.pipe_file(f"{s3_bucket}/models/tiny/model.safetensors", bytes(changed))
    after = fingerprint_model(f"s3://{s3_bucket}/models/tiny/")
    what = pin.changes(after)
    assert what is not None and what.startswith("model.safetensors was") and "etag" in what

    s3.pipe_file(f"{s3_bucket}/models/one.gguf", weights)
    one = fingerprint_model(f"s3://{s3_bucket}/models/one.gguf")
    assert one.files[0].name == "" and one.files[0].digest == f"etag:{hashlib.md5(weights).hexdigest()}"
