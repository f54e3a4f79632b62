"""The test side of hold_shard_preload.py: load it into a cluster's workers, arm it, and wait for the held
shards' records under a local OUTPUT. A test that must stop a shard mid-run (a kill, a SIGTERM, a cancel, a signal
to the client) holds it this way instead of hoping that generation is slow."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hold_shard_preload
from distributed import Client

from pipeline.layout import parse_attempt_record, parse_part

PRELOAD = Path(hold_shard_preload.__file__)
WAIT_S = 600.0  # a hang guard only: every wait here ends on a record


def preload_env(claim: Path, after_rows: int = 2, shards: int = 1) -> dict[str, str]:
    """Environment variables for a process (`tokenmill run`, a test process before its LocalCluster starts) whose
    Dask workers load the preload armed with `claim` (hold_shard_preload's module docstring)."""
    return {"DASK_DISTRIBUTED__WORKER__PRELOAD": json.dumps([str(PRELOAD)]), "HOLD_SHARD_CLAIM": str(claim),
            "HOLD_SHARD_AFTER_ROWS": str(after_rows), "HOLD_SHARD_SHARDS": str(shards)}


@contextlib.contextmanager
def armed(client: Client, claim: Path, after_rows: int = 2, shards: int = 1) -> Iterator[None]:
    """Arm the preload in every worker of `client`'s cluster (loaded there with LocalCluster(preload=[PRELOAD]))
    for one test: a cluster shared by several tests takes a claim file per test. Disarmed on the way out."""
    client.run(hold_shard_preload.arm, str(claim), after_rows, shards)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a worker of the test may be gone
            client.run(hold_shard_preload.disarm)


def _wait(what: str, found: object) -> None:
    raise AssertionError(f"no {what} after {WAIT_S:g} s: the hold never began ({found})")


def held_pid(claim: Path, running: Callable[[], bool] | None = None) -> int:
    """The pid of the worker process that holds (it writes the claim file as the hold begins); waits for it, or
    fails once `running()` (whether the run whose workers should hold goes on) is False."""
    deadline = time.monotonic() + WAIT_S
    while not claim.exists():
        if time.monotonic() > deadline:
            _wait("claim file", claim)
        if running is not None and not running():
            raise AssertionError("the run ended before any shard was held")
        time.sleep(0.02)
    return int(claim.read_text())


def held_attempts(out: Path, claim: Path, shards: int = 1,
                  running: Callable[[], bool] | None = None) -> tuple[int, list[tuple[str, int]]]:
    """Wait until a worker holds and `shards` of its attempts under the local OUTPUT `out` (start records with its
    pid) have each committed a checkpoint part; return (its pid, [(shard id, attempt number)]). Fails once
    `running()` (whether the run whose workers should hold goes on) is False."""
    pid = held_pid(claim, running)
    deadline = time.monotonic() + WAIT_S
    while True:
        held = []
        for record in sorted(out.glob("attempts/*/attempt-*.json")):
            parsed = parse_attempt_record(record.name)
            if parsed is None or parsed[1] != "start" or json.loads(record.read_text())["pid"] != pid:
                continue
            shard_id, attempt = record.parent.name, parsed[0]
            markers = [p for p in (out / "checkpoints" / shard_id).glob("*.commit")
                       if (part := parse_part(p.name)) is not None and part[0] == attempt]
            if markers:
                held.append((shard_id, attempt))
        if len(held) >= shards:
            return pid, held
        if time.monotonic() > deadline:
            _wait(f"{shards} committed parts of held attempts", held)
        if running is not None and not running():
            raise AssertionError(f"the run ended before its held shards committed a part ({held})")
        time.sleep(0.02)
