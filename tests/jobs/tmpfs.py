"""A real tmpfs of a given size for tests of a full local disk (root only: a test is skipped where mounting is not
allowed)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (mount's syntax: "1m", "300k") at the new folder `mount`, yield it, unmount it after
    (lazily when busy). Skips the calling test where it cannot be mounted."""
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and mount rights): {res.stderr.strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
