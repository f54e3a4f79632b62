"""sentence-transformers' Dense modules after pooling (engine.pooling.st_config.DenseConfig, engine.pooling.dense):
a tiny BERT + mean pooling + Dense + Normalize saved by sentence-transformers, embedded by tokenmill against
sentence-transformers' encode of the same folder on real texts (cosine >= 0.99999, fp32), for a tanh and an
identity activation; the weights from pytorch_model.bin as from model.safetensors; a Dense module tokenmill does
not run refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from st_folders import save_bert_dense

from engine import EngineConfig, LLMEngine
from engine.pooling.dense import Dense
from engine.pooling.st_config import read_pooling_config

CPU_FP32 = EngineConfig(device="cpu", dtype="float32")
OUT = 48


@pytest.fixture(scope="module", params=["Tanh", "Identity"])
def dense_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, minilm_folder: str) -> Path:
    activation = getattr(torch.nn, request.param)()
    return save_bert_dense(tmp_path_factory.mktemp(f"bert-dense-{request.param}") / "model", minilm_folder,
                           activation, OUT)


def test_embeddings_equal_sentence_transformers(dense_folder: Path, embed_texts: list[str]) -> None:
    from sentence_transformers import SentenceTransformer

    texts = embed_texts[:64]
    theirs = SentenceTransformer(str(dense_folder), device="cpu").encode(texts, batch_size=16, convert_to_numpy=True)
    engine = LLMEngine.from_model(str(dense_folder), CPU_FP32)
    dense = engine.pooling_runner.pooling.dense
    assert len(dense) == 1 and (dense[0].in_features, dense[0].out_features) == (64, OUT)
    ours = np.stack([o.embedding for o in engine.embed(texts)])
    assert ours.shape == theirs.shape == (len(texts), OUT)
    cosine = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(theirs, axis=-1)
    assert cosine.min() >= 0.99999
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)
    assert engine.embed(texts[:2], dimensions=16)[0].embedding.shape == (16,)  # Matryoshka cut of Dense's output


def test_weights_from_pytorch_model_bin(dense_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    config = read_pooling_config(str(dense_folder), 64, 128).dense[0]
    folder = tmp_path / "2_Dense"
    folder.mkdir()
    shutil.copy(Path(config.folder) / "config.json", folder / "config.json")
    torch.save(load_file(str(Path(config.folder) / "model.safetensors")), folder / "pytorch_model.bin")
    x = torch.randn(3, 64)
    moved = dataclasses.replace(config, folder=str(folder))
    torch.testing.assert_close(Dense(moved, torch.device("cpu"))(x), Dense(config, torch.device("cpu"))(x))
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor pytorch_model.bin"):
        Dense(moved, torch.device("cpu"))


def _edited(folder: Path, tmp_path: Path, dense_config: dict | None = None, modules: list | None = None) -> str:
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    dense_dir = next(p for p in copy.iterdir() if p.name.endswith("_Dense"))
    if dense_config is not None:
        config = json.loads((dense_dir / "config.json").read_text())
        (dense_dir / "config.json").write_text(json.dumps({**config, **dense_config}))
    if modules is not None:
        (copy / "modules.json").write_text(json.dumps(modules))
    return str(copy)


def test_a_dense_module_tokenmill_does_not_run_is_named(dense_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"activation_function 'torch.nn.modules.activation.Softplus'"):
        read_pooling_config(_edited(dense_folder, tmp_path / "a", {
            "activation_function": "torch.nn.modules.activation.Softplus"}), 64, 128)
    with pytest.raises(ValueError, match="takes vectors of 32 elements, but what comes before it gives 64"):
        read_pooling_config(_edited(dense_folder, tmp_path / "b", {"in_features": 32}), 64, 128)
    with pytest.raises(ValueError, match="a Dense module over"):
        read_pooling_config(_edited(dense_folder, tmp_path / "c", {"module_input_name": "token_embeddings"}), 64, 128)
    modules = json.loads((dense_folder / "modules.json").read_text())
    with pytest.raises(ValueError, match="in that order"):  # Dense before Pooling
        read_pooling_config(_edited(dense_folder, tmp_path / "d", modules=[modules[0], modules[2], modules[1]]),
                            64, 128)
    with pytest.raises(ValueError, match="config.json says"):  # weights of another shape than the config's
        engine_folder = _edited(dense_folder, tmp_path / "e", {"in_features": 64, "out_features": OUT, "bias": False})
        Dense(read_pooling_config(engine_folder, 64, 128).dense[0], torch.device("cpu"))
