"""A running cluster's workers moved, for one test, into the environment a job there needs: the variables of an S3
the test serves (endpoint, credentials) or another working directory. The session's LocalCluster (`shared_cluster`,
tests/jobs/conftest.py) then runs such a job as a cluster started in that environment would, without a cluster's
start-up and model load per test; every worker is put back as it was when the block ends."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from distributed import Client

#: The variables through which tests/s3_faults.py (flaky_s3_env) points boto and s3fs at its S3.
S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_MAX_ATTEMPTS",
          "AWS_RETRY_MODE")


def _set_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """In a worker (client.run): set (str) or unset (None) `values` in os.environ, drop the cached S3 filesystems
    (made under the environment before), and return what the variables were."""
    import os

    from s3fs import S3FileSystem

    before = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    S3FileSystem.clear_instance_cache()
    return before


@contextlib.contextmanager
def workers_in(address: str, env: tuple[str, ...] = (), cwd: str | None = None) -> Iterator[None]:
    """Within the block, the workers of the cluster at `address` have this process's values of the variables `env`
    (unset where this process has none) and, if given, the working directory `cwd`; after it, their own again."""
    with Client(address, set_as_default=False) as client:
        envs = client.run(_set_env, {k: os.environ.get(k) for k in env})
        cwds = client.run(os.getcwd)
        if cwd is not None:
            client.run(os.chdir, cwd)
            if set(client.run(os.getcwd).values()) != {cwd}:
                raise RuntimeError(f"the workers of {address} did not move to {cwd}")
    try:
        yield
    finally:
        with Client(address, set_as_default=False) as client:
            for worker, values in envs.items():
                client.run(_set_env, values, workers=[worker])
                client.run(os.chdir, cwds[worker], workers=[worker])
