"""GemLite's kernel configs (engine.quant.gemlite_int4 runs its INT4 kernels): loaded from gemlite's shipped file
of the GPU, tuned at engine load for every (kernel, M bucket) the engine can hit, and cached per GPU model and gemlite
version, so tuning is paid once per device.

Kernel configs (read in gemlite 0.6.0.post2's source: core.py, triton_kernels/{config,utils,*_kernels}.py):
- Each kernel is a `triton.autotune` keyed by (M bucket, N, K, group size, elements per int32, type id, ...); the M
  bucket is `utils.get_closest_m(M)`: the next of 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, ...
  On the first call of a new key its `early_config_prune` looks the key up in gemlite's global config cache
  (`GEMLITE_TRITON_CONFIG_CACHE`, filled by `gemlite.load_config(json)`): a hit yields that one config (compiled,
  not benchmarked); a miss benchmarks the whole list of the autotune mode (`gemlite.set_autotune`: "fast" = its
  default, ~20 configs for GEMM_SPLITK, each compiled then timed; "max" = every combination, ~1500 configs per key
  after pruning, hours per model; "default" = 1-2 configs, no tuning).
- At import gemlite loads the shipped file whose name is in the GPU's name (configs/h100.json, a100, l40s, 4090,
  ...; tuned for Llama-3-8B's shapes among others, g64/g128). There is none for an H200 ("nvidia h200" holds no
  tag), so on the H200 run of 2026-11-26 every (shape, M bucket) was tuned with "fast" inside the first calls:
  gemlite's fast list lacks the H100 file's picks at these shapes (e.g. gate_up at M 8-16: BLOCK_N 512, BLOCK_K 64,
  SPLIT_K 16), which is our reading of that run's slow M 8-128 (bench/README.md "GPU"; unverified until re-run).
- `gemlite.cache_config(json)` writes every key tuned so far (all kernels' autotuner caches plus the global cache).

What we do (`tune_gemlite`, called at engine load by engine.quant.int4_linear.prepare_int4_kernels): load the
shipped file of the GPU, or of the same chip where gemlite finds none by name (GEMLITE_CONFIG_ALIASES: H200 -> h100),
load our per-device cache (config_cache_path: keyed by GPU name and gemlite version, beside the weights cache),
run each layer shape once at every (kernel, M bucket) the engine can hit (its CUDA-graph batch sizes and prefill
chunks up to max_num_batched_tokens), so tuning and Triton compiles happen at load, before any step or capture, and
write the keys tuned there back to the cache: tuning is paid once per device, later loads only compile.
This is what gemlite's README asks of a server ("one JSON cache file per GPU model"; load it, warm up the shapes
and batch sizes with gemlite.helper.warmup). How TorchAO's GemliteUIntXWeightOnlyConfig and SGLang set gemlite up
was not read (2026-11-26).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from engine.quant.gemlite_int4 import GemLiteInt4, import_gemlite

log = logging.getLogger(__name__)

#: GPUs gemlite 0.6 ships no config file for, mapped to the shipped file of the same chip: the H200, GH200 and
#: H800 are GH100 dies like the H100 (132 SMs, sm_90; the H200 has more and faster HBM). Used only where gemlite's
#: own choice (a shipped file's name in the GPU's name) finds none.
GEMLITE_CONFIG_ALIASES = {"gh200": "h100", "h200": "h100", "h800": "h100"}

#: gemlite's autotune mode for keys no loaded config covers: "fast" is gemlite's default (~20 configs a key);
#: "max" takes hours per model (bench/int4.py --gemlite-max-rows times it on a few keys).
GEMLITE_AUTOTUNE = "fast"

#: Bumped whenever what a config-cache file holds changes (its name includes it).
GEMLITE_CONFIG_FORMAT = 1

#: gemlite's kernels with a config cache, by name (core.GEMLITE_MATMUL_TYPES).
GEMLITE_MATMUL_TYPES = ("GEMV", "GEMV_REVSPLITK", "GEMV_SPLITK", "GEMM_SPLITK", "GEMM")


@dataclasses.dataclass
class GemLiteTuning:
    """What `tune_gemlite` did: `keys` (kernel, gemlite signature) the engine can hit, `tuned` of them autotuned
    now (no loaded config had them), `seconds` of wall time (tuning, compiles and the warm-up calls), the config
    files loaded (`loaded`: gemlite's shipped file of an aliased GPU, our cache) and the cache file written (or
    None when nothing new was tuned or the write failed)."""

    keys: int
    tuned: int
    seconds: float
    loaded: list[str]
    written: Path | None


def shipped_config_name(device_name: str, shipped: Iterable[str]) -> str | None:
    """The gemlite config file (its stem, e.g. "h100") for a GPU named `device_name`: gemlite's own rule (the longest
    shipped stem found in the lower-cased name, spaces as underscores; core.get_default_cache_config), else
    GEMLITE_CONFIG_ALIASES' entry found in the name, else None."""
    found = gemlite_own_config(device_name, shipped)
    if found is not None:
        return found
    name = device_name.lower().replace(" ", "_")
    alias = next((a for a in sorted(GEMLITE_CONFIG_ALIASES, key=len, reverse=True) if a in name), None)
    return GEMLITE_CONFIG_ALIASES[alias] if alias is not None and GEMLITE_CONFIG_ALIASES[alias] in shipped else None


def gemlite_own_config(device_name: str, shipped: Iterable[str]) -> str | None:
    """The shipped config gemlite itself loads at import for this GPU (core.get_default_cache_config), or None."""
    name = device_name.lower().replace(" ", "_")
    return next((t for t in sorted(shipped, key=len, reverse=True) if t in name), None)


def config_cache_path(device_name: str, gemlite_version: str, root: Path | None = None) -> Path:
    """Our GemLite config cache for one GPU model and gemlite version: `root` (default
    engine.text.tokenizer.cache_root(),
    beside the weights cache) / "gemlite" / "<gpu>-gemlite-<version>-v<format>.json"."""
    from engine.text.tokenizer import cache_root

    slug = re.sub(r"[^a-z0-9.]+", "-", device_name.lower()).strip("-")
    return (root or cache_root()) / "gemlite" / f"{slug}-gemlite-{gemlite_version}-v{GEMLITE_CONFIG_FORMAT}.json"


def read_config_cache(path: Path, device_name: str, gemlite_version: str) -> dict[str, dict[str, dict]] | None:
    """The configs of a cache file written by `write_config_cache` ({kernel: {signature: config kwargs}}, gemlite's
    own format), or None when there is none. Raises ValueError (one line, with the fix) when the file was tuned on
    another GPU model, another gemlite version or cache format, or is not such a file: configs tuned elsewhere are
    never used silently."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        meta, configs = data["meta"], data["configs"]
        if not isinstance(configs, dict) or not all(isinstance(v, dict) for v in configs.values()):
            raise TypeError("configs is not a {kernel: {signature: config}} mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a GemLite config cache ({type(e).__name__}: {e}); delete it to retune") from e
    want = {"format": GEMLITE_CONFIG_FORMAT, "device": device_name, "gemlite": gemlite_version}
    got = {k: meta.get(k) for k in want}
    if got != want:
        raise ValueError(f"{path} holds GemLite configs for {got}, not {want}; configs tuned for another GPU or "
                         f"gemlite are not used: delete the file to retune here")
    unknown = set(configs) - set(GEMLITE_MATMUL_TYPES)
    if unknown:
        raise ValueError(f"{path} names kernels {sorted(unknown)} gemlite {gemlite_version} does not have; delete it")
    return configs


def write_config_cache(path: Path, device_name: str, gemlite_version: str, configs: dict[str, dict[str, dict]]
                       ) -> bool:
    """Write `configs` ({kernel: {signature: config kwargs}}) with what they were tuned for, beside the file then
    renamed into place (a concurrent reader never sees half a file). Best effort: False (logged) when the disk
    refuses; the engine then runs the same, tuning again at its next load."""
    meta = {"format": GEMLITE_CONFIG_FORMAT, "device": device_name, "gemlite": gemlite_version,
            "triton": _version("triton"), "torch": torch.__version__, "written": time.strftime("%Y-%m-%d")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"meta": meta, "configs": configs}, f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("GemLite config cache not written at %s (%s: %s)", path, type(e).__name__, e)
        return False
    return True


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def warmup_rows(rows: Iterable[int], kernel_of: Callable[[int], str | None], bucket: Callable[[int], int]
                ) -> dict[tuple[str, int], list[int]]:
    """The calls that tune and compile every GemLite kernel a set of row counts M can hit: {(kernel, M bucket):
    [M, ...]} with the largest and the smallest M of the bucket (Triton compiles a kernel apart for M a multiple of
    16 or of the tile and for other M, so both variants are built). kernel_of(M) is GemLite's kernel for M rows
    (None where another kernel serves M: tinygemm, dequantize); bucket is gemlite's get_closest_m."""
    seen: dict[tuple[str, int], list[int]] = {}
    for m in sorted(set(rows)):
        kernel = kernel_of(m)
        if kernel is not None:
            seen.setdefault((kernel, bucket(m)), []).append(m)
    return {key: sorted({ms[-1], ms[0]}, reverse=True) for key, ms in seen.items()}


def gemlite_signature(layer: GemLiteInt4, m: int) -> str:
    """gemlite's config-cache key of `layer` at M rows: str((get_closest_m(M), N, K, group size, elements per
    int32, type id)), with the type id of fp16 for bf16 activations too (core.forward_functional, and the key
    the kernels' `kernel_config_pruner` looks up)."""
    from gemlite.dtypes import DType
    from gemlite.triton_kernels.utils import get_closest_m

    lin = layer.linear
    kind = DType.FP16 if lin.input_dtype in (DType.FP16, DType.BF16) else lin.input_dtype
    return str((get_closest_m(m), layer.out_features, layer.padded_in_features, layer.group_size,
                lin.elements_per_sample, kind.value * 100 + lin.W_nbits))


def _loaded_configs(gemlite: ModuleType) -> dict[str, dict[str, dict]]:
    import gemlite.core

    return gemlite.core.GEMLITE_TRITON_CONFIG_CACHE


def _load_configs(gemlite: ModuleType, configs: dict[str, dict[str, dict]]) -> None:
    """Merge configs into gemlite's global cache through its public loader (it reads a file)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(configs, f)
        f.flush()
        if not gemlite.load_config(f.name, print_error=True):
            raise RuntimeError(f"gemlite {gemlite.__version__} did not load a config file of its own format")


def _collect_configs(gemlite: ModuleType) -> dict[str, dict[str, dict]]:
    """Every config gemlite holds now (loaded plus tuned in this process), as gemlite.cache_config writes them."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "configs.json")
        gemlite.cache_config(path)
        return json.loads(Path(path).read_text())


def tune_gemlite(layers: Sequence[GemLiteInt4], rows: Iterable[int], kernel_of: Callable[[GemLiteInt4, int], bool],
                 *, device_name: str | None = None, cache: Path | None | str = "auto",
                 autotune: str = GEMLITE_AUTOTUNE) -> GemLiteTuning:
    """Tune and compile GemLite's kernels for `layers` at every M in `rows` that GemLite serves (kernel_of(layer, M)
    True), once per layer shape, before any step: load gemlite's shipped file for this GPU (shipped_config_name:
    its own pick or an alias's), then our cache (a refused or damaged one is logged and replaced), run each
    (kernel, M bucket) of `warmup_rows` once per shape (autotuning keys no config covers, with gemlite's `autotune`
    mode), then write what gemlite holds to the cache when something was tuned.

    Args:
        layers: the GemLiteInt4 of a model (one per distinct (N, Kp, G, dtype) is used).
        rows: the row counts M the engine runs (decode batch sizes, prefill chunk lengths).
        kernel_of: whether GemLite serves `layer` at M rows (engine.quant.int4_linear: tinygemm and dequantize
            serve some M).
        device_name: the GPU model the configs are for (default torch.cuda.get_device_name of the layers' device).
        cache: the cache file; "auto" = config_cache_path(device_name, gemlite version); None = no cache.
        autotune: gemlite.set_autotune mode for uncovered keys ("fast", "max", "default").
    Returns GemLiteTuning. Raises ImportError as import_gemlite, ValueError for an unknown autotune mode.
    """
    if autotune not in ("fast", "max", "default"):
        raise ValueError(f"autotune must be fast, max or default, not {autotune!r}")
    gemlite = import_gemlite()
    from gemlite.triton_kernels.config import AUTOTUNE
    from gemlite.triton_kernels.utils import get_closest_m

    t0 = time.perf_counter()
    by_shape = {(g.out_features, g.padded_in_features, g.group_size, g.dtype): g for g in layers}
    if not by_shape:
        return GemLiteTuning(0, 0, 0.0, [], None)
    first = next(iter(by_shape.values()))
    device = first.linear.W_q.device
    device_name = device_name or torch.cuda.get_device_name(device)
    if any(getattr(AUTOTUNE, k) != autotune for k in GEMLITE_MATMUL_TYPES):
        gemlite.set_autotune(autotune)  # reloads gemlite's kernel modules (their autotuners start empty)
    loaded = []
    shipped_dir = Path(gemlite.__file__).parent / "configs"
    shipped = [p.stem for p in shipped_dir.glob("*.json")]
    name = shipped_config_name(device_name, shipped)
    # gemlite loads its own match at import (not an aliased chip's), and a reset_config drops it: loaded here
    # either way, before our cache so that ours wins (keys already tuned in this process live in the kernels'
    # autotuners, so loading again changes nothing resolved).
    if name is not None and gemlite.load_config(str(shipped_dir / f"{name}.json")):
        loaded.append(str(shipped_dir / f"{name}.json"))
    version = gemlite.__version__
    path = config_cache_path(device_name, version) if cache == "auto" else (Path(cache) if cache else None)
    if path is not None:
        try:
            configs = read_config_cache(path, device_name, version)
        except ValueError as e:
            log.warning("%s; retuning", e)
            configs = None
        if configs:
            _load_configs(gemlite, configs)
            loaded.append(str(path))
    keys, tuned = 0, 0
    with torch.no_grad():
        for layer in by_shape.values():
            plan = warmup_rows(rows, lambda m, layer=layer: layer.matmul_type(m) if kernel_of(layer, m) else None,
                               get_closest_m)
            have = _loaded_configs(gemlite)
            for (kernel, _), ms in plan.items():
                keys += 1
                tuned += gemlite_signature(layer, ms[0]) not in have.get(kernel, {})
                for m in ms:
                    layer(torch.randn(m, layer.padded_in_features, device=device, dtype=layer.dtype))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up inputs and autotuning buffers, before the KV pool is sized
    written = None
    if path is not None and tuned and write_config_cache(path, device_name, version, _collect_configs(gemlite)):
        written = path
    seconds = round(time.perf_counter() - t0, 2)
    log.info("GemLite kernels ready for %d (kernel, M bucket, shape) keys, %d tuned now, in %.1f s (configs: %s)",
             keys, tuned, seconds, ", ".join(loaded) or "none")
    return GemLiteTuning(keys, tuned, seconds, loaded, written)
