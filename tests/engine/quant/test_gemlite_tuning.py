"""GemLite's kernel configs (engine.quant.gemlite_tuning): the per-GPU cache (its keying by GPU model and
gemlite version, its refusal of a file tuned elsewhere), the seed file of an aliased GPU, the warm-up plan over
the engine's row counts and the tuning at load (on the CPU with a stand-in benchmarker, tests/engine/
gemlite_testing.py; for real on a GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gemlite_testing import DEVICE, INTERPRET, gemlite_on_cpu, int4_weight

from engine.quant import gemlite_int4, gemlite_tuning, int4_kernel_plan
from engine.quant.int4_kernel_plan import gemlite_kernel_for


@pytest.fixture(scope="module")
def _gemlite_on_cpu() -> Iterator[None]:
    """gemlite_testing.gemlite_on_cpu for this module's tests."""
    yield from gemlite_on_cpu()


def test_shipped_config_name_follows_gemlite_then_the_aliases() -> None:
    shipped = ["h100", "a100", "l40", "l40s", "l4", "4090"]
    assert gemlite_tuning.shipped_config_name("NVIDIA H100 80GB HBM3", shipped) == "h100"
    assert gemlite_tuning.shipped_config_name("NVIDIA L40S", shipped) == "l40s"  # gemlite's rule: longest name first
    assert gemlite_tuning.shipped_config_name("NVIDIA H200", shipped) == "h100"  # none shipped: the same chip's
    assert gemlite_tuning.shipped_config_name("NVIDIA GH200 480GB", shipped) == "h100"
    assert gemlite_tuning.shipped_config_name("NVIDIA B200", shipped) is None
    assert gemlite_tuning.shipped_config_name("NVIDIA H200", ["a100"]) is None  # the alias's file is not shipped


def test_config_cache_is_keyed_by_gpu_and_gemlite_and_refuses_another(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One cache file per GPU model and gemlite version, under the tokenmill cache root; a file tuned for another
    GPU or gemlite version, or not a cache at all, is refused with a one-line ValueError naming the fix."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    path = gemlite_tuning.config_cache_path("NVIDIA H200", "0.6.0.post2")
    assert path.parent == tmp_path / "gemlite" and "nvidia-h200" in path.name and "0.6.0.post2" in path.name
    assert len({path, gemlite_tuning.config_cache_path("NVIDIA H100 80GB HBM3", "0.6.0.post2"),
                gemlite_tuning.config_cache_path("NVIDIA H200", "0.6.1")}) == 3
    assert gemlite_tuning.read_config_cache(path, "NVIDIA H200", "0.6.0.post2") is None  # none yet
    configs = {"GEMM_SPLITK": {"(16, 28672, 4096, 128, 8, 104)": {"BLOCK_SIZE_M": 16, "SPLIT_K": 16,
                                                                  "num_warps": 4, "num_stages": 1}}}
    assert gemlite_tuning.write_config_cache(path, "NVIDIA H200", "0.6.0.post2", configs)
    assert gemlite_tuning.read_config_cache(path, "NVIDIA H200", "0.6.0.post2") == configs
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    for device, version, what in (("NVIDIA H100 80GB HBM3", "0.6.0.post2", "NVIDIA H200"),
                                  ("NVIDIA H200", "0.6.1", "0.6.0.post2")):
        with pytest.raises(ValueError, match="delete the file to retune") as e:
            gemlite_tuning.read_config_cache(path, device, version)
        assert what in str(e.value) and "\n" not in str(e.value)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a GemLite config cache"):
        gemlite_tuning.read_config_cache(path, "NVIDIA H200", "0.6.0.post2")
    gemlite_tuning.write_config_cache(path, "NVIDIA H200", "0.6.0.post2", {"GEMM_FUTURE": {}})
    with pytest.raises(ValueError, match="GEMM_FUTURE"):
        gemlite_tuning.read_config_cache(path, "NVIDIA H200", "0.6.0.post2")


def test_warmup_rows_cover_every_kernel_and_m_bucket(_gemlite_on_cpu: None) -> None:
    """The warm-up calls for M 1..2048 with the engine's thresholds: one (kernel, gemlite M bucket) per key, run at
    its largest and smallest M; nothing where tinygemm or dequantize serve."""
    from gemlite.core import get_matmul_type
    from gemlite.triton_kernels.utils import get_closest_m

    tiny, dequant = int4_kernel_plan.CUDA_TINYGEMM_MAX_ROWS, int4_kernel_plan.CUDA_GEMLITE_DEQUANT_MIN_ROWS
    plan = gemlite_tuning.warmup_rows(
        range(1, 2049), lambda m: get_matmul_type(m, 4) if gemlite_kernel_for(m, tiny, dequant) == "gemlite" else None,
        get_closest_m)
    assert plan[("GEMM_SPLITK", 16)] == [16, 9]
    assert plan[("GEMM_SPLITK", 64)] == [63, 49] and plan[("GEMM", 64)] == [64]  # M 64 leaves split-K
    assert plan[("GEMM", 128)] == [128, 97] and plan[("GEMM", 2048)] == [2047, 1537]
    covered = {m for ms in plan.values() for m in ms}
    assert min(covered) == tiny + 1 and max(covered) == dequant - 1
    for m in (9, 24, 100, 1000, 2047):  # every M served by GemLite falls in a warmed key
        assert (get_matmul_type(m, 4), get_closest_m(m)) in plan
    assert not any(k == "GEMV_REVSPLITK" for k, _ in plan)  # M <= 4 is tinygemm's here


def test_tune_gemlite_tunes_once_and_caches_per_gpu(_gemlite_on_cpu: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """tune_gemlite at engine load: the keys no config covers are autotuned (here by the stand-in benchmarker),
    written under gemlite's own signatures (gemlite_signature is the key its kernels look up), and a second load
    tunes nothing: it reads the cache. An H200 is seeded with gemlite's shipped H100 file."""
    import copy
    import json

    import gemlite.core

    if not INTERPRET:
        pytest.skip("runs gemlite's autotuner with a stand-in benchmarker; the GPU test below tunes for real")
    monkeypatch.setattr(gemlite.core, "GEMLITE_TRITON_CONFIG_CACHE",
                        copy.deepcopy(gemlite.core.GEMLITE_TRITON_CONFIG_CACHE))
    g = gemlite_int4.GemLiteInt4(int4_weight(128, 256, 64, seed=3), torch.float16, DEVICE)
    cache = tmp_path / "h200.json"
    args = ([g, g], [1, 2, 24], lambda layer, m: m != 2)
    done = gemlite_tuning.tune_gemlite(*args, device_name="NVIDIA H200", cache=cache)
    assert (done.keys, done.tuned, done.written) == (2, 2, cache)
    assert any(p.endswith("h100.json") for p in done.loaded)
    saved = json.loads(cache.read_text())
    assert saved["meta"]["device"] == "NVIDIA H200"
    for m, kernel in ((1, "GEMV_REVSPLITK"), (24, "GEMM_SPLITK")):
        assert gemlite_tuning.gemlite_signature(g, m) in saved["configs"][kernel]
    again = gemlite_tuning.tune_gemlite(*args, device_name="NVIDIA H200", cache=cache)
    assert (again.keys, again.tuned, again.written) == (2, 0, None) and str(cache) in again.loaded
    with pytest.raises(ValueError, match="autotune"):
        gemlite_tuning.tune_gemlite(*args, device_name="NVIDIA H200", cache=cache, autotune="slow")


@pytest.mark.gpu
def test_prepare_int4_kernels_tunes_at_load_then_reads_the_cache(_gemlite_on_cpu: None, tmp_path: Path) -> None:
    """On a GPU: the engine-load step tunes every (kernel, M bucket) of each layer shape GemLite serves in M 1..256
    (shapes no shipped file has), writes the cache, and a second load tunes nothing."""
    if INTERPRET:
        pytest.skip("needs a CUDA device: Int4Linear builds GemLite's kernels on cuda only")
    from gemlite.core import get_matmul_type
    from gemlite.triton_kernels.utils import get_closest_m
    from torch import nn

    from engine.quant.int4_linear import Int4Linear, prepare_int4_kernels

    model = nn.Sequential(Int4Linear(int4_weight(512, 1024, 128, seed=1), torch.bfloat16, "cuda"),
                          Int4Linear(int4_weight(1024, 512, 128, seed=2), torch.bfloat16, "cuda"))
    lin = model[0]
    keys = gemlite_tuning.warmup_rows(range(1, 257), lambda m: get_matmul_type(m, 4) if lin.kernel_for(m) == "gemlite"
                                    else None, get_closest_m)
    cache = tmp_path / "gpu.json"
    first = prepare_int4_kernels(model, 256, cache=cache)
    assert (first.keys, first.written) == (2 * len(keys), cache) and first.tuned > 0
    second = prepare_int4_kernels(model, 256, cache=cache)
    assert (second.keys, second.tuned, second.written) == (2 * len(keys), 0, None)
    assert prepare_int4_kernels(nn.Sequential(nn.Linear(4, 4)), 256) is None  # nothing runs GemLite


def test_prepare_int4_kernels_warms_only_the_m_gemlite_serves(_gemlite_on_cpu: None, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine-load step on the CPU: an fp16 Int4Linear given GemLite's kernels as on CUDA (interpreter) with
    dequantize from M 6; prepare_int4_kernels(max_rows=8) warms GEMV_REVSPLITK at M 1, 2, 4 and GEMM_SPLITK's bucket
    8 at M 5 only (6-8 are dequantize's), once for two layers of one shape, and writes them under the GPU's name."""
    import copy
    import json

    import gemlite.core
    from torch import nn

    from engine.quant.int4_linear import Int4Linear, prepare_int4_kernels

    if not INTERPRET:
        pytest.skip("the CPU stand-in of the GPU test below")
    monkeypatch.setattr(gemlite.core, "GEMLITE_TRITON_CONFIG_CACHE",
                        copy.deepcopy(gemlite.core.GEMLITE_TRITON_CONFIG_CACHE))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    q = int4_weight(64, 256, 64, seed=11)
    layers = []
    for _ in range(2):
        lin = Int4Linear(q, torch.float16, "cpu")
        lin.gemlite, lin.dequant_min_rows = gemlite_int4.GemLiteInt4(q, torch.float16, "cpu"), 6
        layers.append(lin)
    assert [layers[0].kernel_for(m) for m in (1, 5, 6)] == ["gemlite", "gemlite", "dequant"]
    cache = tmp_path / "h200.json"
    done = prepare_int4_kernels(nn.Sequential(*layers), 8, cache=cache)
    assert (done.keys, done.written) == (4, cache)
    configs = json.loads(cache.read_text())["configs"]
    g = layers[0].gemlite
    for m, kernel in ((1, "GEMV_REVSPLITK"), (2, "GEMV_REVSPLITK"), (4, "GEMV_REVSPLITK"), (5, "GEMM_SPLITK")):
        assert gemlite_tuning.gemlite_signature(g, m) in configs[kernel]
    assert prepare_int4_kernels(nn.Sequential(Int4Linear(q, torch.float16, "cpu")), 8) is None  # no GemLite here
