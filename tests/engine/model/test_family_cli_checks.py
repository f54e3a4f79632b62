"""The command line refuses a Hugging Face folder it cannot run before any work: an architecture tokenmill does not
run is exit 2 naming it with nothing written, and `--max-model-len` is bounded by the folder's own context. The
folders are tiny random models of the Llama-shaped families (tests/engine/llama_family_models.py), as
test_families.py runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")

# tests/engine, on sys.path through tests/engine/conftest.py
from llama_family_models import build_family, copy_folder, edit_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory, gguf_path: str) -> dict[str, tuple]:
    """(HF model, HF folder, GGUF file) of the families these tests use: llama and qwen3."""
    from engine.text.tokenizer import Tokenizer

    hf_tok = Tokenizer.from_gguf(gguf_path).hf_tokenizer
    root = tmp_path_factory.mktemp("families")
    return {f: build_family(root, f, gguf_path, hf_tok) for f in ("llama", "qwen3")}


def test_cli_refuses_bad_folder_before_work(families, gsm8k_questions, tmp_path: Path) -> None:
    """`tokenmill run --model DIR` with an unknown architecture exits 2 naming it, and writes nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = copy_folder(families["llama"][1], tmp_path)
    edit_config(bad, model_type="falcon")
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"question": gsm8k_questions[:2]}), data)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(data), str(out), "--prompt-column",
                           "question", "--model", str(bad)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "'falcon' is not supported" in proc.stderr + proc.stdout
    assert not out.exists() or not any(out.iterdir())


def test_max_model_len_is_checked_against_an_hf_folder_context(families) -> None:
    """`--max-model-len` is bounded by a Hugging Face folder's own context (config.json), before any work."""
    from jobs.errors import JobError
    from jobs.plan.preflight import check_max_model_len, model_context

    model, folder, _ = families["qwen3"]
    shape = model_context(str(folder))
    assert shape == {"context": model.config.max_position_embeddings, "layers": model.config.num_hidden_layers,
                     "kv_heads": model.config.num_key_value_heads, "head_dim": model.config.head_dim}
    check_max_model_len(str(folder), "cpu", "float32", shape["context"], 1.0)
    with pytest.raises(JobError, match=f"more than the context of qwen3, {shape['context']} tokens"):
        check_max_model_len(str(folder), "cpu", "float32", shape["context"] + 1, 1.0)
