"""An EnginePlugin that leaves a file for each engine load it starts, so a test counts the loads of a job's workers
(processes of their own) by counting files, never by timing. Dask workers unpickle the plugin by this module's name
(tests/jobs is on their sys.path as on the test's)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

from jobs.plugin import EnginePlugin


class CountedEnginePlugin(EnginePlugin):
    """EnginePlugin whose every load (EnginePlugin._load, which `_load_once` runs at most once per worker) first
    writes `<loads_dir>/<pid>-<uuid>.load`. Its name (an engine plugin's, jobs.plugin.PLUGIN_PREFIX first) also
    names `loads_dir`: on a cluster that outlives a test, a worker that holds the same engine under another test's
    plugin (or the plain EnginePlugin) gets this one registered, not skipped as already there, and loads and counts
    its engine afresh."""

    def __init__(self, loads_dir: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loads_dir = loads_dir
        self.name = f"{self.name}-counted-{hashlib.sha256(loads_dir.encode()).hexdigest()[:12]}"

    def _load(self) -> None:
        Path(self.loads_dir, f"{os.getpid()}-{uuid.uuid4().hex}.load").touch()
        super()._load()


def loads(loads_dir: Path) -> int:
    """Engine loads recorded under `loads_dir`."""
    return len(list(loads_dir.glob("*.load")))
