"""The cluster's workers as the user sees them: where the LocalCluster's dashboard is (say_dashboard), and the wait
for a GPU worker to join a cluster that scales from zero (worker_wait_s, wait_for_gpu_worker). jobs.cluster runs the
shards on them."""

from __future__ import annotations

import importlib.util
import json
import sys
import time

from distributed import Client

from jobs.errors import JobError
from schemas import settings

# The LocalCluster's dashboard: a free port on this machine, so two jobs on one machine never clash over Dask's
# default 8787 ("Port 8787 is already in use"); say_dashboard tells the user where it is.
DASHBOARD_ADDRESS = "127.0.0.1:0"

def say_dashboard(link: str) -> None:
    """Print once, on stderr, where the LocalCluster's Dask dashboard is (and that it needs bokeh, when missing): a
    line of text on a terminal, else a JSON line `{"event": "dashboard", "url": ...}` like the progress events (logs
    that machines read: Airflow, Kubernetes)."""
    bokeh = importlib.util.find_spec("bokeh") is not None
    if sys.stderr.isatty():
        need = "" if bokeh else " (pip install bokeh to see it)"
        print(f"Dask dashboard of this run: {link}{need}", file=sys.stderr, flush=True)
    else:
        print(json.dumps({"event": "dashboard", "url": link, "needs_bokeh": not bokeh}), file=sys.stderr, flush=True)


WORKER_WAIT_ENV = settings.WORKER_WAIT_S


def worker_wait_s() -> float:
    """Seconds a run waits for a GPU worker to join the cluster (env TOKENMILL_WORKER_WAIT_S, default 0: none).
    Set it where workers scale from zero (Karpenter, cluster autoscaler). Raises JobError for a bad value."""
    try:
        return settings.env_seconds(WORKER_WAIT_ENV, 0.0, allow_zero=True)
    except ValueError as e:
        raise JobError(str(e)) from None


def wait_for_gpu_worker(client: Client, wait_s: float) -> bool:
    """True once a worker of `client`'s cluster offers a GPU resource; polls every 2 s for up to `wait_s` s."""
    deadline = time.monotonic() + wait_s
    while not any(w.get("resources", {}).get("GPU") for w in client.scheduler_info()["workers"].values()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    return True
