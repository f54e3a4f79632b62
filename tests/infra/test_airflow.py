"""infra/airflow/tokenmill_dag.py in a real Airflow 3 (its own venv: Airflow's pins conflict with ours): the DAG folder
imports without errors, `airflow dags test` runs the BashOperator DAG on a small real job to success, a second run of
the same logical date does no work, and tokenmill's exit codes become Airflow's outcomes.

Under a minute on the 2-core AVX2 EPYC, about half the time of the three `dags test` runs before, most of it
Airflow's own start: one `airflow dags test` (the CLI, then the in-process execution API and task runner: ~15 s
before the task's command starts) and one process in Airflow's interpreter for the rest. `make test` (what CI runs)
and `make airflow-test` install Airflow into .airflow-venv when it is missing and run these
(TOKENMILL_AIRFLOW_TESTS=1; another venv with TOKENMILL_AIRFLOW_VENV); a plain `pytest` skips them."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAG_FILE = ROOT / "infra" / "airflow" / "tokenmill_dag.py"
VENV = Path(os.environ.get("TOKENMILL_AIRFLOW_VENV", ROOT / ".airflow-venv")).resolve()  # commands run in tmp dirs

pytestmark = [pytest.mark.airflow, pytest.mark.skipif(
    os.environ.get("TOKENMILL_AIRFLOW_TESTS") != "1",
    reason="Airflow tests need Airflow's own venv: `make test` or `make airflow-test` runs them "
           "(TOKENMILL_AIRFLOW_TESTS=1)")]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "AIRFLOW", "VIRTUAL_ENV"))}


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite metadata DB that `airflow db migrate` brought to Airflow's schema, once for the module; each test
    gets a copy of its own (`airflow`)."""
    airflow_bin = VENV / "bin" / "airflow"
    if not airflow_bin.is_file():
        pytest.skip(f"Airflow is not installed at {VENV} (could pip reach apache-airflow? `make airflow-venv` "
                    "says why), or set TOKENMILL_AIRFLOW_VENV")
    home = tmp_path_factory.mktemp("airflow-template")
    env = _clean_env() | {"AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    subprocess.run([str(airflow_bin), "db", "migrate"], env=env, check=True, capture_output=True, cwd=home)
    return home / "airflow.db"


@pytest.fixture
def airflow_env(tmp_path: Path, tokenmill_env: dict[str, str]) -> dict[str, str]:
    """The environment of Airflow's processes: a temporary AIRFLOW_HOME, the DAG folder holding only
    tokenmill_dag.py, and TOKENMILL_BIN, a tokenmill that runs this checkout (the CPU engine's plain torch path: fast
    to start, and text quality does not matter here). No metadata DB: parsing the DAG folder needs none."""
    home, dags = tmp_path / "airflow", tmp_path / "airflow" / "dags"
    dags.mkdir(parents=True)
    shutil.copy(DAG_FILE, dags)
    tokenmill = tmp_path / "tokenmill"
    tokenmill.write_text(f'#!/bin/sh\nPYTHONPATH="{tokenmill_env["PYTHONPATH"]}" TOKENMILL_CPU_KERNELS=0 '
                         f'exec "{Path(sys.executable).with_name("tokenmill")}" "$@"\n')
    tokenmill.chmod(0o755)
    return _clean_env() | {
        "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "TOKENMILL_BIN": str(tokenmill), "TOKENMILL_OUTPUT_ROOT": str(tmp_path / "runs")}


@pytest.fixture
def airflow(airflow_env: dict[str, str], migrated_db: Path) -> tuple[list[str], dict[str, str]]:
    """The airflow command and `airflow_env` with a migrated SQLite metadata DB in its AIRFLOW_HOME (a copy of
    `migrated_db`)."""
    shutil.copyfile(migrated_db, Path(airflow_env["AIRFLOW_HOME"]) / "airflow.db")
    return [str(VENV / "bin" / "airflow")], airflow_env


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd, timeout=600)


def test_the_dag_folder_imports_and_exit_codes_map_to_outcomes(airflow_env: dict[str, str], tmp_path: Path) -> None:
    """In one process of Airflow's interpreter (each Airflow CLI command would start Airflow again): the DAG folder
    parses as `airflow dags list` / `list-import-errors` parse it (Airflow's DagBag) with both DAGs and no import
    error; the exit-code mapping and the pod operator's setup; and the local DAG's real task, run on a spec that does
    not exist, runs the real tokenmill, which exits 2, and fails with AirflowFailException: the exception whose task
    Airflow fails without its retries (a transient failure's AirflowException would be retried)."""
    if not (VENV / "bin" / "python").is_file():
        pytest.skip(f"Airflow is not installed at {VENV} (could pip reach apache-airflow? `make airflow-venv` "
                    "says why), or set TOKENMILL_AIRFLOW_VENV")
    env = airflow_env | {"TOKENMILL_JOB_SPEC": str(tmp_path / "missing.yaml")}
    check = f"""
import importlib.util
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from kubernetes.client import models as k8s
bag = DagBag(dag_folder={env["AIRFLOW__CORE__DAGS_FOLDER"]!r})
assert not bag.import_errors, bag.import_errors
assert set(bag.dag_ids) == {{"tokenmill_nightly_local", "tokenmill_nightly_k8s"}}, bag.dag_ids
spec = importlib.util.spec_from_file_location("tokenmill_dag", {str(DAG_FILE)!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)

def outcome(code):
    try:
        m.raise_for_exit_code(code, "tokenmill submit")
    except AirflowFailException:
        return "fail"
    except AirflowException:
        return "retry"
    return "ok"

assert [outcome(c) for c in (0, 1, 2, 3, 4, 137)] == ["ok", "retry", "fail", "retry", "fail", "retry"]
terminated = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=2))
pod = k8s.V1Pod(status=k8s.V1PodStatus(container_statuses=[k8s.V1ContainerStatus(
    name="base", image="i", image_id="", ready=False, restart_count=0, state=terminated)]))
assert m.container_exit_code(pod, "base") == 2 and m.container_exit_code(pod, "other") is None
task = m.k8s_dag.get_task("submit")
assert task.deferrable and task.arguments[:2] == ["tokenmill", "submit"] and "{{{{ ds_nodash }}}}" in task.arguments[4]
assert "DASK_SCHEDULER_ADDRESS" in str(task.env_vars)
local = m.local_dag.get_task("submit")
assert local.retries > 0 and local.retry_delay.total_seconds() >= m.LEASE_TTL_S
# A bad spec (exit 2) fails the task at once, without the retries a transient failure gets.
try:
    local.execute({{}})
except AirflowFailException as e:
    assert "exited 2: bad input" in str(e), e
else:
    raise AssertionError("the task on a missing spec did not raise AirflowFailException")
print("ok")
"""
    res = _run([str(VENV / "bin" / "python"), "-c", check], env, tmp_path)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-3000:] + res.stderr[-3000:]
    assert "job spec" in res.stdout + res.stderr and "not found" in res.stdout + res.stderr  # tokenmill's own line


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def test_dags_test_runs_the_job_and_a_rerun_of_the_day_is_a_no_op(airflow: tuple[list[str], dict[str, str]],
                                                                  small_job: Path, tmp_path: Path) -> None:
    """One `airflow dags test` of a day runs the job to success, into an OUTPUT keyed on the logical date (each
    `dags test` gets a new run id). A rerun of that day runs the command the task ran, as Airflow rendered it (from
    the task's log): tokenmill finds the job finished and writes nothing. A second `dags test` would only run that
    same command again, after ~15 s of Airflow's own start."""
    cmd, env = airflow
    env = env | {"TOKENMILL_JOB_SPEC": str(small_job)}
    first = _run([*cmd, "dags", "test", "tokenmill_nightly_local", "2026-01-01"], env, tmp_path)
    log = first.stdout + first.stderr
    assert first.returncode == 0 and "new_state=success" in log, log[-3000:]
    out = tmp_path / "runs" / "20260101"  # keyed on the logical date, not the run id
    assert (out / "_SUCCESS").is_file()
    before = _files(out)

    (ran,) = re.findall(r"Running command: (\[.*?\])", log)  # the SubprocessHook's line: [bash, -c, rendered command]
    rendered = ast.literal_eval(ran)
    assert rendered[-1].endswith(f'submit "{small_job}" --output "{out}/" --json'), rendered
    again = _run(rendered, env, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]  # the task would succeed: exit 0 maps to success
    assert '"already_done": true' in again.stdout + again.stderr  # tokenmill's summary: the job was finished
    assert _files(out) == before  # nothing written, nothing rewritten
