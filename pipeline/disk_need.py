"""How many bytes a job stopped by a full local disk still has to write: an estimate from what its committed parts
took, for the one line of exit 6 (issue 51 item 3: the failed write alone is never the whole need)."""

from __future__ import annotations

import contextlib
import os

from fsspec.implementations.local import LocalFileSystem

from pipeline.layout import checkpoints_dir, parse_part, results_path
from pipeline.storage import read_fs

# Blocks a shard writes beside its rows: its results file's own overhead, its accounting, its attempt records.
SHARD_RECORD_BLOCKS = 4
# Blocks the job writes once more: a lease record or two, _SUCCESS.
JOB_RECORD_BLOCKS = 4


def _on_disk(path: str) -> int:
    """Bytes `path` takes on its device (whole blocks), 0 when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return st.st_blocks * 512


def bytes_still_needed(output_url: str, shards: dict[str, int]) -> tuple[int, int] | None:
    """(bytes, rows) for a local OUTPUT: an estimate of what the job still writes under OUTPUT, in bytes on its
    device, from `rows` rows committed in checkpoint parts so far (their parts' and markers' blocks per row).
    `shards`: the shards of the run, shard id -> rows (those with results committed are left out). Each unfinished
    row is written twice (its part, then the shard's merged results), a committed part's rows once more (the
    results), and each shard and the job a few records. None when OUTPUT is not local or no part is committed yet
    (nothing to estimate from). Never raises for a missing folder."""
    fs, root = read_fs(output_url)
    if not isinstance(fs, LocalFileSystem):
        return None
    part_bytes, part_rows, block = 0, 0, 4096
    with contextlib.suppress(OSError):
        block = os.statvfs(root).f_frsize or block
    shards = {s: rows for s, rows in shards.items() if not os.path.exists(results_path(root, s))}
    committed: dict[str, int] = {}
    for shard_id in shards:
        folder = checkpoints_dir(root, shard_id)
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            parsed = parse_part(name)
            if parsed is None:
                continue
            part_bytes += _on_disk(os.path.join(folder, name))
            if parsed[3]:  # a marker: its part is committed
                committed[shard_id] = committed.get(shard_id, 0) + parsed[2]
                part_rows += parsed[2]
    if not part_rows:
        return None
    per_row = part_bytes / part_rows
    rows_left = sum(max(rows - committed.get(s, 0), 0) for s, rows in shards.items())
    need = per_row * (rows_left + sum(shards.values())) + block * (
        SHARD_RECORD_BLOCKS * len(shards) + JOB_RECORD_BLOCKS)
    return -(-int(need) // block) * block, part_rows


def no_space_line(error: str, output_url: str, shards: dict[str, int]) -> str:
    """The exit-6 line: `error` (pipeline.storage.no_space_left's: the failed write) and what the rest of the job
    needs, estimated by bytes_still_needed, or that no estimate exists yet. One line; never raises (an estimate
    that cannot be made is left out)."""
    try:
        need = bytes_still_needed(output_url, shards)
    except (OSError, ValueError):
        need = None
    if need is None:
        return f"{error}; the rest of the job needs more (no rows committed yet to estimate it from)"
    total, rows = need
    return (f"{error}; the rest of the job needs about {total:,} bytes more in all (estimated from the {rows:,} rows "
            f"committed so far: free that much for one rerun to finish)")
