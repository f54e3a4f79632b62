"""The CLI imports lazily what each command needs: every `tokenmill` process (tests, Airflow tasks, a user's
`--help`) would otherwise pay ~3 s for torch and Dask before doing anything (issue 31)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "distributed", "dask", "transformers", "pyarrow", "pydantic", "numpy", "fsspec", "yaml", "jinja2",
         "huggingface_hub", "safetensors", "gguf")


def _run_probe(code: str) -> tuple[dict[str, bool], list[str]]:
    """Which of HEAVY a fresh interpreter has imported after running `code` (a fresh process: this one has them),
    and the lines `code` printed before."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


def _loaded_after(code: str) -> dict[str, bool]:
    """Which of HEAVY a fresh interpreter has imported after running `code` (_run_probe)."""
    return _run_probe(code)[0]


def test_import_and_help_load_neither_torch_nor_dask_nor_arrow_nor_the_spec_model() -> None:
    """`tokenmill --help` loads Typer and rich only (issue 41: under 0.5 s; measured with `python -X importtime`,
    never timed here): none of HEAVY, the data and model libraries included."""
    code = ("import sys\nimport jobs.cli\nsys.argv = ['tokenmill', '--help']\n"
            "try:\n    jobs.cli.app()\nexcept SystemExit:\n    pass")
    assert _loaded_after(code) == dict.fromkeys(HEAVY, False)


@pytest.mark.parametrize("command", ["status", "cancel"])
def test_status_and_cancel_load_no_torch_nor_dask(command: str, tmp_path: Path) -> None:
    # No job at the folder: the command reads OUTPUT, says so and exits 2, having imported what it needs.
    code = (f"import sys\nimport jobs.cli\nsys.argv = ['tokenmill', {command!r}, {str(tmp_path)!r}]\n"
            "try:\n    jobs.cli.app()\nexcept SystemExit as e:\n    assert e.code == 2, e.code")
    loaded = _loaded_after(code)
    assert loaded["pyarrow"]  # it did read the job's folder (Arrow tables), so the probe would see a torch import
    assert {m: loaded[m] for m in ("torch", "distributed", "dask", "transformers")} == dict.fromkeys(
        ("torch", "distributed", "dask", "transformers"), False)


def test_run_client_never_imports_torch(tiny_model: str, data_dir: Path, tmp_path: Path) -> None:
    """A real `tokenmill run` of a model folder on its embedded LocalCluster: the engine (torch) loads in the Dask
    worker processes only, the client checks the model's header, pins it, submits the shard tasks and gathers
    their results without importing torch (~3 CPU-s per client; issue 31)."""
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(0, 3),
                   inp / "a.parquet")
    args = ["tokenmill", "run", str(inp), str(tmp_path / "out"), "--model", tiny_model, "--prompt-column",
            "question", "--max-tokens", "2", "--workers", "1", "--json"]
    code = (f"import sys\nimport jobs.cli\nsys.argv = {args!r}\n"
            "try:\n    jobs.cli.app()\nexcept SystemExit as e:\n    assert not e.code, e.code")
    loaded, printed = _run_probe(code)
    summary = json.loads(printed[-1])
    assert (summary["rows_ok"], summary["output_tokens"]) == (3, 6)  # the workers loaded the engine and ran it
    assert loaded["distributed"] and not loaded["torch"], loaded


def test_the_client_checks_decide_as_the_engine_without_torch(gguf_path: str, tiny_model: str) -> None:
    """The fit check of a GGUF file (native INT4 Q4_1) and of a model folder, and the --max-model-len pool check,
    choose device and dtype, and which weights are linear or native INT4, through the engine's torch-free modules
    (engine.worker.device_choice, engine.loading.gguf_native_int4, engine.model.tensor_names; issue 52)."""
    code = ("from engine.config import EngineConfig\nfrom jobs.errors import JobError\n"
            "from jobs.plan.model_fit import model_fit\nfrom jobs.plan.preflight import check_max_model_len, "
            f"model_context\nfor m in ({gguf_path!r}, {tiny_model!r}):\n"
            "    print(model_fit(m, EngineConfig(device='cpu'), model_context(m)).model_bytes)\n"
            f"try:\n    check_max_model_len({tiny_model!r}, 'cpu', 'auto', 8192, 0.0001)\n"
            "except JobError as e:\n    print(e)")
    loaded, printed = _run_probe(code)
    assert int(printed[0]) > 0 and int(printed[1]) > 0, printed
    assert "is more than the KV cache of --kv-cache-gib 0.0001 holds" in printed[2], printed
    assert not loaded["torch"], loaded


def test_help_lists_every_command_with_the_help_it_has_when_built() -> None:
    """`--help` lists the lazily built commands (jobs.cli._LazyGroup) from their docstrings: the same text, in the
    same order, as the commands themselves once built."""
    import typer

    from jobs.cli import _LAZY_COMMANDS, _ORDER, app

    group = typer.main.get_command(app)
    ctx = group.make_context("tokenmill", ["--help"], resilient_parsing=True)
    assert group.list_commands(ctx) == list(_ORDER)
    group._listing = True  # what `tokenmill --help` sees (jobs.cli._LazyGroup.format_help)
    listed = {name: group.get_command(ctx, name) for name in _LAZY_COMMANDS}
    group._listing = False
    for name in _LAZY_COMMANDS:
        built = group.get_command(ctx, name)
        assert built.name == name and built.params and not listed[name].params  # built: its options generated
        assert listed[name].help == built.help, name
