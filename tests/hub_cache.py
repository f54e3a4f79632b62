"""A Hugging Face hub cache built by hand, in the layout huggingface_hub writes, for tests of hub ids (no test
downloads anything)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def write_hub_cache(home: Path, repo_id: str, folder: str) -> str:
    """A hub cache under `home` (HF_HOME) holding the files of `folder` as repo_id's `main` snapshot: blobs named by
    their SHA-256, snapshot files as relative links to them, refs/main naming the commit. Returns the snapshot
    folder."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in os.listdir(folder):
        data = Path(folder, name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return str(snapshot)
