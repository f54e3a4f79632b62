"""Pooling from a model's sentence-transformers files (engine.pooling.st_config) and on packed rows
(engine.pooling.pooler) against sentence-transformers' own Pooling module on the padded batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.pooling.pooler import pool
from engine.pooling.st_config import POOLING_MODES, PoolingConfig, read_pooling_config


@pytest.mark.parametrize("modes", [("mean",), ("cls",), ("max",), ("lasttoken",), ("mean_sqrt_len_tokens",),
                                   ("cls", "mean", "max")])
@pytest.mark.parametrize("normalize", [False, True])
def test_pool_is_sentence_transformers_pooling(modes: tuple[str, ...], normalize: bool) -> None:
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    torch.manual_seed(0)
    lens, hidden = [7, 1, 4, 7, 2], 16
    packed = torch.randn(sum(lens), hidden)
    padded = torch.zeros(len(lens), max(lens), hidden)
    mask = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    start = 0
    for b, n in enumerate(lens):
        padded[b, :n], mask[b, :n] = packed[start:start + n], 1
        start += n
    theirs = Pooling(hidden, pooling_mode=modes)({"token_embeddings": padded, "attention_mask": mask})
    expected = theirs["sentence_embedding"]
    if normalize:
        expected = torch.nn.functional.normalize(expected, dim=-1)
    ours = pool(packed, lens, PoolingConfig(modes=modes, normalize=normalize))
    assert ours.dtype == torch.float32 and ours.shape == (len(lens), hidden * len(modes))
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-6)


def _folder(tmp_path: Path, minilm_folder: str, modules: list[dict] | None = None, pooling: dict | None = None) -> str:
    folder = tmp_path / "model"
    (folder / "1_Pooling").mkdir(parents=True)
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        shutil.copy(Path(minilm_folder) / name, folder / name)
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(folder)


def test_the_default_models_files(minilm_folder: str) -> None:
    cfg = read_pooling_config(minilm_folder, 384, 512, 512)
    assert cfg == PoolingConfig(modes=("mean",), normalize=True, max_seq_length=256, source="modules.json")


def test_modes_and_normalize_follow_the_files(tmp_path: Path, minilm_folder: str) -> None:
    modules = json.loads((Path(minilm_folder) / "modules.json").read_text())
    folder = _folder(tmp_path, minilm_folder, modules=modules[:2],
                     pooling={"word_embedding_dimension": 384, "pooling_mode": ["cls", "max"]})
    cfg = read_pooling_config(folder, 384, 512)
    assert (cfg.modes, cfg.normalize, cfg.dimension(384)) == (("cls", "max"), False, 768)
    legacy = {"word_embedding_dimension": 384, "pooling_mode_lasttoken": True, "pooling_mode_cls_token": True}
    assert read_pooling_config(_folder(tmp_path / "b", minilm_folder, pooling=legacy), 384, 512).modes == (
        "cls", "lasttoken")  # sentence-transformers' order of the legacy flags
    assert set(POOLING_MODES) == {"cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken"}


def test_no_modules_json_pools_by_mean(tmp_path: Path) -> None:
    cfg = read_pooling_config(str(tmp_path), 64, 96, 512)
    assert cfg == PoolingConfig(modes=("mean",), normalize=False, max_seq_length=96, source="default")


def test_an_unknown_module_or_mode_is_named(tmp_path: Path, minilm_folder: str) -> None:
    modules = json.loads((Path(minilm_folder) / "modules.json").read_text())
    norm = {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}
    with pytest.raises(ValueError, match=r"module 'sentence_transformers.models.LayerNorm'"):
        read_pooling_config(_folder(tmp_path / "a", minilm_folder, modules=[*modules[:2], norm]), 384, 512)
    with pytest.raises(ValueError, match="pooling mode 'weightedmean'"):
        read_pooling_config(_folder(tmp_path / "b", minilm_folder,
                                    pooling={"word_embedding_dimension": 384, "pooling_mode": "weightedmean"}),
                            384, 512)
    with pytest.raises(ValueError, match="in that order"):
        read_pooling_config(_folder(tmp_path / "c", minilm_folder, modules=modules[1:]), 384, 512)
    with pytest.raises(ValueError, match="hidden size is 64"):
        read_pooling_config(_folder(tmp_path / "d", minilm_folder), 64, 512)
