"""What tokenmill's benchmarks share: where the prompt data is, the CPU and CUDA timers, the argparse preamble and
one way to run a worker in a fresh interpreter.

Run a benchmark as a module from the repository root: `python -m bench.NAME --help` (bench/README.md). Only the
standard library at import: torch loads in the timers that need it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import settings

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    """The real prompt sets (gsm8k_test.parquet, alpaca_eval.parquet): $TOKENMILL_DATA_DIR, else ../shared/data
    beside the checkout (as tests/conftest.py finds them)."""
    return Path(settings.env_text(settings.DATA_DIR) or ROOT.parent / "shared" / "data")


def data_file(name: str) -> Path:
    """`name` in data_dir(). Raises FileNotFoundError naming the folder and the variable when it is not there."""
    path = data_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: set TOKENMILL_DATA_DIR to the folder of the prompt sets")
    return path


def read_column(name: str, column: str) -> list:
    """One column of a prompt set in data_dir() (e.g. read_column("gsm8k_test.parquet", "question")), in file
    order."""
    import pyarrow.parquet as pq

    return pq.read_table(data_file(name), columns=[column]).column(column).to_pylist()


def real_texts() -> list[str]:
    """The distinct non-empty texts of the shared prompt sets (GSM8K test questions and answers, AlpacaEval
    instructions and reference outputs: 4,248, 4 to about 2,000 words), interleaved so that every slice mixes the
    four."""
    import pyarrow.parquet as pq

    gsm = pq.read_table(data_file("gsm8k_test.parquet"), columns=["question", "answer"])
    alpaca = pq.read_table(data_file("alpaca_eval.parquet"), columns=["instruction", "reference_output"])
    columns = [gsm.column("question").to_pylist(), alpaca.column("instruction").to_pylist(),
               gsm.column("answer").to_pylist(), alpaca.column("reference_output").to_pylist()]
    seen: set[str] = set()
    out: list[str] = []
    for i in range(max(len(c) for c in columns)):
        for c in columns:
            if i < len(c) and isinstance(c[i], str) and c[i].strip() and c[i] not in seen:
                seen.add(c[i])
                out.append(c[i])
    return out


def emit(**row: object) -> None:
    """Print one measurement as a JSON line (flushed: a benchmark cut short keeps its rows)."""
    print(json.dumps(row), flush=True)


def median_s(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall seconds of `fn()` over `reps` calls after `warmup` untimed ones (time.perf_counter: a CPU
    timer; for CUDA work use cuda_ms, which waits for the device)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cuda_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median device milliseconds of one `fn()` on the current CUDA stream over `iters` calls after `warmup` untimed
    ones, each between two CUDA events (the host's launch time is not in it unless the device waited for it)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def triton_device(name: str, smoke: str) -> torch.device:
    """torch.device(name) for a benchmark of Triton kernels: CUDA when a device is there, else any device under
    TRITON_INTERPRET=1 (the interpreter: a smoke run). Raises SystemExit naming the problem and `smoke`, the
    smoke-run flags (e.g. "--device cpu --tiny"), otherwise."""
    import torch

    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda needs a CUDA device; for a smoke run: TRITON_INTERPRET=1 ... {smoke}")
    if device.type != "cuda" and not settings.triton_interpret():
        raise SystemExit(f"--device {name}: the Triton kernels run off CUDA only under TRITON_INTERPRET=1")
    return device


def new_parser(doc: str | None, *, threads: int | None | bool = False) -> argparse.ArgumentParser:
    """The benchmark's argument parser: its module docstring as the description (kept as written). `threads`:
    also a --threads option with this default (None: torch's own count); False: none. Call set_threads(args)
    after parsing."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if threads is not False:
        ap.add_argument("--threads", type=int, default=threads,
                        help=f"torch threads (default: {threads if threads is not None else 'torch' + chr(39) + 's'})")
    return ap


def preset_parser(doc: str | None, option: str, choices: Sequence[str], tiny_help: str) -> argparse.ArgumentParser:
    """new_parser(doc) with the options of the GPU benchmarks over random-weight shapes (bench.embed_gpu,
    bench.vision_gpu): `option` (e.g. "--family": one of `choices`, repeatable; none given: all), --device (cuda),
    --dtype (bfloat16), --price-per-hour (USD per device-hour: the per-dollar figures), --tokenizer (a BERT uncased
    tokenizer's folder) and --tiny (`tiny_help` says what the smoke run's shapes are)."""
    ap = new_parser(doc)
    ap.add_argument(option, choices=sorted(choices), action="append", help="one to run (repeat for several; "
                    "default: all)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--price-per-hour", type=float, default=3.0, help="USD per device-hour, for the per-dollar figures")
    ap.add_argument("--tokenizer", help="a BERT uncased tokenizer's folder (default: embed_gpu.tokenizer_folder's)")
    ap.add_argument("--tiny", action="store_true", help=tiny_help)
    return ap


def set_threads(args: argparse.Namespace) -> None:
    """torch.set_num_threads(args.threads) when the option was given a count."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def run_worker(module: str, args: Sequence[str], timeout: float | None, python: str | None = None) -> dict:
    """Run `python -m module *args RESULT` in a fresh interpreter (a benchmark's worker: one system, one
    configuration; `python`: another virtual environment's interpreter, default this one's) and return the JSON
    object it wrote to RESULT (a temporary file, its last argument), or
    {"status": "failed", "detail": ...} for a crash (its last line of output), a signal or a timeout. The worker
    runs in its own process group, killed whole on a timeout: a worker's server (llama-server) left running would
    share the cores with every system measured after it."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    with subprocess.Popen([python or sys.executable, "-m", module, *args, str(result)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException as e:  # a timeout, or Ctrl-C to the benchmark (the group is not the terminal's)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            result.unlink(missing_ok=True)
            if isinstance(e, subprocess.TimeoutExpired):
                return {"status": "failed", "detail": f"timed out after {timeout:.0f} s"}
            raise
    try:
        if proc.returncode < 0:
            return {"status": "failed", "detail": f"killed by signal {-proc.returncode}"}
        if proc.returncode != 0 or not result.stat().st_size:
            tail = (stderr or stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            return {"status": "failed", "detail": tail[0][:200]}
        return json.loads(result.read_text())
    finally:
        result.unlink(missing_ok=True)


def best_seconds(fn: Callable[[], object], repeats: int = 5, clock: Callable[[], float] = time.perf_counter) -> float:
    """The shortest of `repeats` timed calls of `fn` after one untimed warm-up call, in seconds of `clock` (wall
    time by default; time.process_time for CPU seconds)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best
