"""tokenmill's nightly job in Airflow 3 (airflow.sdk): two DAGs, one per place the job's driver runs.

- `tokenmill_nightly_k8s`: a KubernetesPodOperator (deferrable: the pod runs while the triggerer, not a worker slot,
  waits) that runs `tokenmill submit` in tokenmill's image against the Dask cluster of infra/k8s.
- `tokenmill_nightly_local`: a BashOperator that runs `tokenmill submit` where Airflow runs (no Kubernetes; an
  embedded Dask LocalCluster, or DASK_SCHEDULER_ADDRESS).

OUTPUT is keyed on the run's logical date (`<output_root>/{{ ds_nodash }}/`), not on the run id, so Airflow's retries
and reruns of a day resume that day's job (tokenmill's lease and pinned manifest) or find it finished and do nothing.
tokenmill's exit codes (jobs/errors.py) become Airflow outcomes: 2 (bad input, options or spec) fails the task
without retries; 3 (another run holds the job) is retried after the lease TTL; 4 (cancelled) fails the task without
retries, visibly; 1 (failed shards) and the rest are retried (a rerun redoes only what is missing).

Settings come from the environment of Airflow's processes (read when the file is parsed): TOKENMILL_JOB_SPEC,
TOKENMILL_OUTPUT_ROOT, TOKENMILL_IMAGE, TOKENMILL_NAMESPACE, TOKENMILL_DASK_SCHEDULER, TOKENMILL_LEASE_TTL_S,
TOKENMILL_SCHEDULE. Install: infra/README.md ("Airflow").
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG
from airflow.sdk.exceptions import AirflowException, AirflowFailException

JOB_SPEC = os.environ.get("TOKENMILL_JOB_SPEC", "/etc/tokenmill/job.yaml")
OUTPUT_ROOT = os.environ.get("TOKENMILL_OUTPUT_ROOT", "s3://my-bucket/jobs/nightly").rstrip("/")
IMAGE = os.environ.get("TOKENMILL_IMAGE", "registry.example.com/tokenmill:0.1.0")
NAMESPACE = os.environ.get("TOKENMILL_NAMESPACE", "tokenmill")
DASK_SCHEDULER = os.environ.get("TOKENMILL_DASK_SCHEDULER", "tcp://dask-scheduler.tokenmill:8786")
LEASE_TTL_S = float(os.environ.get("TOKENMILL_LEASE_TTL_S", "60"))  # tokenmill's lease TTL (jobs/lease.py)
SCHEDULE = os.environ.get("TOKENMILL_SCHEDULE", "30 2 * * *")
OUTPUT = OUTPUT_ROOT + "/{{ ds_nodash }}/"  # one job per logical date: reruns resume it or do nothing

DEFAULT_ARGS: dict[str, Any] = {
    "owner": "tokenmill",
    "retries": 3,
    # Long enough for a dead run's lease to expire (exit 3 means a run holds it).
    "retry_delay": timedelta(seconds=LEASE_TTL_S + 30),
}
# One run at a time (a second would find the job's lease held); no backfill of missed days unless asked.
DAG_ARGS: dict[str, Any] = {"schedule": SCHEDULE, "start_date": pendulum.datetime(2026, 1, 1, tz="UTC"),
                            "catchup": False, "max_active_runs": 1, "default_args": DEFAULT_ARGS,
                            "tags": ["tokenmill"], "doc_md": __doc__}


def raise_for_exit_code(code: int | None, what: str) -> None:
    """Turn tokenmill's exit code into the Airflow outcome: None or 0 returns; 2 and 4 raise AirflowFailException
    (no retry); 3, 1 and any other raise AirflowException (retried). `what` names the process in the message."""
    if code in (None, 0):
        return
    if code == 2:
        raise AirflowFailException(f"{what} exited 2: bad input, options or job spec (nothing ran). Fix them; a retry "
                                   "would fail the same way")
    if code == 4:
        raise AirflowFailException(f"{what} exited 4: the job was cancelled (`tokenmill cancel`). Resume it with "
                                   "`tokenmill submit ... --resume`, then clear this task")
    if code == 3:
        raise AirflowException(f"{what} exited 3: another run holds the job's lease; retrying after it expires")
    raise AirflowException(f"{what} exited {code}" + (": some shards failed; a retry runs only those" if code == 1
                                                      else ""))


class TokenmillBashOperator(BashOperator):
    """BashOperator whose command's exit code is read as tokenmill's (raise_for_exit_code)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(skip_on_exit_code=None, **kwargs)

    def execute(self, context: Any) -> Any:
        try:
            return super().execute(context)
        except AirflowException as e:
            process = self.subprocess_hook.sub_process
            raise_for_exit_code(process.returncode if process is not None else None, "tokenmill submit")
            raise e


with DAG(dag_id="tokenmill_nightly_local", **DAG_ARGS) as local_dag:
    TokenmillBashOperator(
        task_id="submit",
        # NOTE: tokenmill must be on the PATH of Airflow's workers (or set TOKENMILL_BIN to its full path).
        bash_command=(f'"${{TOKENMILL_BIN:-tokenmill}}" submit "{JOB_SPEC}" --output "{OUTPUT}" --json'),
    )

try:
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from kubernetes.client import models as k8s
except ImportError:  # the provider is optional: without it only the local DAG exists
    KubernetesPodOperator = None

if KubernetesPodOperator is not None:

    class TokenmillPodOperator(KubernetesPodOperator):
        """KubernetesPodOperator whose base container's exit code is read as tokenmill's (raise_for_exit_code)."""

        def cleanup(self, pod: Any, remote_pod: Any, *args: Any, **kwargs: Any) -> None:
            try:
                super().cleanup(pod, remote_pod, *args, **kwargs)
            except AirflowException as e:
                raise_for_exit_code(container_exit_code(remote_pod, self.base_container_name), "tokenmill submit")
                raise e

    def container_exit_code(pod: Any, container: str) -> int | None:
        """The exit code of a pod's terminated container, or None when it has none."""
        statuses = (pod.status.container_statuses if pod is not None and pod.status else None) or []
        for status in statuses:
            if status.name == container and status.state and status.state.terminated:
                return status.state.terminated.exit_code
        return None

    with DAG(dag_id="tokenmill_nightly_k8s", **DAG_ARGS) as k8s_dag:
        TokenmillPodOperator(
            task_id="submit",
            name="tokenmill-submit",
            namespace=NAMESPACE,
            image=IMAGE,
            service_account_name="tokenmill",  # infra/k8s: the identity that reads input and writes OUTPUT
            arguments=["tokenmill", "submit", "/etc/tokenmill/job.yaml", "--output", OUTPUT, "--json"],
            env_vars={"DASK_SCHEDULER_ADDRESS": DASK_SCHEDULER, "TOKENMILL_WORKER_WAIT_S": "900"},
            volumes=[k8s.V1Volume(name="job", config_map=k8s.V1ConfigMapVolumeSource(name="tokenmill-job"))],
            volume_mounts=[k8s.V1VolumeMount(name="job", mount_path="/etc/tokenmill", read_only=True)],
            container_resources=k8s.V1ResourceRequirements(requests={"cpu": "500m", "memory": "1Gi"},
                                                           limits={"memory": "2Gi"}),
            deferrable=True,
            get_logs=True,
            on_finish_action="delete_pod",
        )
