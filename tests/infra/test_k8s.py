"""infra/k8s: every overlay renders with `kubectl kustomize`, every object validates against the Kubernetes schemas
(kubernetes-validate ships them, offline), and the invariants tokenmill relies on hold."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.plugin import DRAIN_MARGIN_S
from schemas.job_spec import load_job_spec

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KUBERNETES_VERSION = "1.32.0"  # the oldest minor the clouds' standard channels still run
# Seconds a stopping worker needs beyond TOKENMILL_STOP_DEADLINE_S: the engine's current step, the end record, the
# worker's close after the drain (it waits up to DRAIN_MARGIN_S for them, but needs far less).
STOP_MARGIN_S = 7


def test_overlays_exist() -> None:
    assert set(OVERLAYS) == {"cpu", "eks", "gke", "karpenter"}


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize` renders for an overlay."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (apt-get install kubectl): it renders the kustomizations")
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(name)]
    return obj


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_objects_validate_against_the_kubernetes_schemas(overlay: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate "
                                              "(the test extras): it holds the Kubernetes schemas")
    objects = render(overlay)
    assert {o["kind"] for o in objects} == {"ConfigMap", "CronJob", "Deployment", "Service", "ServiceAccount"}
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises ValidationError, naming the field


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_invariants(overlay: str, tmp_path: Path) -> None:
    objects = render(overlay)
    gpu = overlay != "cpu"
    service = _one(objects, "Service", "dask-scheduler")
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "comm")
    address = f"tcp://{service['metadata']['name']}:{port}"

    # The Dask config (mounted at /etc/dask in scheduler and workers): what a spot fleet and the engine need.
    dask = yaml.safe_load(_one(objects, "ConfigMap", "tokenmill-dask")["data"]["tokenmill.yaml"])["distributed"]
    assert dask["scheduler"]["allowed-failures"] >= 10 and dask["worker"]["profile"]["enabled"] is False
    assert dask["nanny"]["pre-spawn-environ"]["MALLOC_TRIM_THRESHOLD_"] is None
    assert dask["nanny"]["pre-spawn-environ"]["OMP_WAIT_POLICY"] == "PASSIVE"  # jobs/process_env.py

    worker = _one(objects, "Deployment", "tokenmill-worker")["spec"]["template"]["spec"]
    (container,) = worker["containers"]
    args = container["args"]
    assert args[:3] == ["dask", "worker", address] and args[args.index("--nthreads") + 1] == "1"
    limits = container["resources"].get("limits", {})
    if gpu:  # one GPU per worker, offered to Dask as the resource every shard asks for
        assert args[args.index("--resources") + 1] == "GPU=1" and limits["nvidia.com/gpu"] == 1
    else:
        assert "--resources" not in args and "nvidia.com/gpu" not in limits
    assert any("spot" in k or "spot" in str(v).lower() for k, v in worker["nodeSelector"].items())
    for spec in (worker, _one(objects, "Deployment", "dask-scheduler")["spec"]["template"]["spec"]):
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        (volume,) = [v for v in spec["volumes"] if v["name"] == "dask-config"]
        assert mounts["dask-config"] == "/etc/dask" and volume["configMap"]["name"].startswith("tokenmill-dask")

    # The stop: preStop writes the notice file the worker watches, on a volume; the grace period covers the deadline.
    env = {e["name"]: e.get("value") for e in container["env"]}
    notice, deadline = env["TOKENMILL_SPOT_NOTICE_FILE"], float(env["TOKENMILL_STOP_DEADLINE_S"])
    hook = shlex.split(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert hook == ["touch", notice]  # no sleep: the hook's time counts against the grace period
    assert any(notice.startswith(m["mountPath"] + "/") for m in container["volumeMounts"])
    grace = worker["terminationGracePeriodSeconds"]
    assert grace >= deadline + STOP_MARGIN_S and STOP_MARGIN_S <= DRAIN_MARGIN_S
    if overlay == "gke":
        assert grace <= 15  # what GKE's graceful node shutdown gives a pod on a preempted spot VM

    # The CronJob: one run at a time, `tokenmill submit` of a valid spec, on this cluster, exit codes mapped.
    cron = _one(objects, "CronJob", "tokenmill-nightly")["spec"]
    assert cron["concurrencyPolicy"] == "Forbid"
    job = cron["jobTemplate"]["spec"]
    (submit,) = job["template"]["spec"]["containers"]
    assert "exec tokenmill submit /etc/tokenmill/job.yaml --output" in submit["args"][-1]
    submit_env = {e["name"]: e.get("value") for e in submit["env"]}
    assert submit_env["DASK_SCHEDULER_ADDRESS"] == address and float(submit_env["TOKENMILL_WORKER_WAIT_S"]) > 0
    actions = {code: r["action"] for r in job["podFailurePolicy"]["rules"] if "onExitCodes" in r
               for code in r["onExitCodes"]["values"]}
    assert actions == {2: "FailJob", 4: "FailJob", 3: "Ignore"}
    (mount,) = submit["volumeMounts"]
    assert mount["mountPath"] == "/etc/tokenmill"
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(_one(objects, "ConfigMap", "tokenmill-job")["data"]["job.yaml"])
    spec = load_job_spec(str(spec_file))  # raises JobSpecError naming the field
    assert spec.cluster.gpus_per_worker == (1 if gpu else 0) and spec.engine.device == ("cuda" if gpu else "cpu")
