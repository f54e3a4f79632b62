"""Where everything lives under a job's OUTPUT: the one place that spells its paths and parses its names.

    OUTPUT/
      _manifest/input.json                          the pinned input (pipeline.manifest)
      _manifest/input-NNN.json                      a revision re-pinning changed files (NNN from 001)
      _manifest/model.json                          the pinned model: its files' sizes and hashes (pipeline.model_pin)
      _manifest/cancel-NNN.json                     a cancel marker set aside by `--resume` (jobs.control)
      _lease/SSSSSSSSSSSS.json                      who runs the job until when (jobs.lease)
      _input/requests.parquet                       an OpenAI batch file's requests, converted (jobs.formats)
      results/<shard_id>.parquet                    a shard's results (schemas.RESULTS_SCHEMA)
      accounting/<shard_id>.attempt-NNN.parquet     the bill of the attempt that finished the shard
      checkpoints/<shard_id>/aNNN-pPPPPP-nROWS.parquet|.commit
                                                    part PPPPP of attempt NNN, ROWS rows, and its commit marker
      attempts/<shard_id>/attempt-NNN.json          attempt NNN's start (pipeline.attempts)
      attempts/<shard_id>/attempt-NNN.end.json      how it ended (interrupted, failed)
      attempts/<shard_id>/attempt-NNN.end-dDDDDDDDDDD.json
                                                    it ended on a full disk, after DDDDDDDDDD device-ms: an empty
                                                    file, the name is the record (it needs no data block)
      attempts/<shard_id>/attempt-NNN.alive-MMMMMMMMMM[-dDDDDDDDDDD].json
                                                    a sign of life MMMMMMMMMM ms after its start, having held
                                                    DDDDDDDDDD device-ms (its share of a shared engine)
      _CANCEL                                       present while the job is cancelled
      _SUCCESS                                      committed last: the job's shards and totals

Every function takes `root`: the OUTPUT as an fsspec URL or as the protocol-less path of one (a trailing slash is
dropped); an empty `root` gives the path relative to OUTPUT. The README's "Output layout" section is the spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

MANIFEST_DIR = "_manifest"
MANIFEST = f"{MANIFEST_DIR}/input.json"  # relative to OUTPUT: revision 0, pinned when the job starts
MODEL_PIN = f"{MANIFEST_DIR}/model.json"  # relative to OUTPUT: the model, pinned when the job starts
LEASE_DIR = "_lease"
STAGED_REQUESTS = "_input/requests.parquet"
RESULTS_DIR = "results"
ACCOUNTING_DIR = "accounting"
CHECKPOINTS_DIR = "checkpoints"
ATTEMPTS_DIR = "attempts"
CANCEL = "_CANCEL"
SUCCESS = "_SUCCESS"

_REVISION = re.compile(r"^input(?:-(\d+))?\.json$")  # input.json, input-001.json, ...
_CANCEL_ASIDE = re.compile(r"^cancel-(\d+)\.json$")
_LEASE = re.compile(r"^(\d+)(?:\.json)?$")
_PART = re.compile(r"^a(\d+)-p(\d+)-n(\d+)\.(parquet|commit)$")
_ATTEMPT = re.compile(r"^attempt-(\d+)(?:(\.end)(?:-d(\d+))?|\.alive-(\d+)(?:-d(\d+))?)?\.json$")

RecordKind = Literal["start", "end", "alive"]


def _under(root: str, relative: str) -> str:
    root = root.rstrip("/")
    return f"{root}/{relative}" if root else relative


def basename(path: str) -> str:
    """The last part of a listed path (what the parse_* functions read)."""
    return path.rsplit("/", 1)[-1]


# -- the job's own records ----------------------------------------------------------------------------------------

def manifest_dir(root: str) -> str:
    """The folder of the input manifest, its revisions and set-aside cancel markers."""
    return _under(root, MANIFEST_DIR)


def manifest_path(root: str, revision: int = 0) -> str:
    """Where revision `revision` of the job's input manifest is committed (0: _manifest/input.json)."""
    return _under(root, MANIFEST if revision == 0 else f"{MANIFEST_DIR}/input-{revision:03d}.json")


def parse_manifest_revision(path: str) -> int | None:
    """The revision a listed _manifest/ entry holds (0 for input.json), or None when it is no manifest."""
    m = _REVISION.match(basename(path))
    return None if m is None else int(m.group(1) or 0)


def model_pin_path(root: str) -> str:
    """Where the job's pinned model is committed (pipeline.model_pin)."""
    return _under(root, MODEL_PIN)


def cancel_aside_path(root: str, n: int) -> str:
    """Where the `n`th lifted cancel marker is set aside."""
    return _under(root, f"{MANIFEST_DIR}/cancel-{n:03d}.json")


def is_cancel_aside(path: str) -> bool:
    """True when a listed _manifest/ entry is a set-aside cancel marker."""
    return _CANCEL_ASIDE.match(basename(path)) is not None


def lease_dir(root: str) -> str:
    """The folder of the job's lease records."""
    return _under(root, LEASE_DIR)


def lease_path(root: str, seq: int) -> str:
    """Where lease record `seq` is committed (zero-padded, so names sort as numbers)."""
    return _under(root, f"{LEASE_DIR}/{seq:012d}.json")


def parse_lease_seq(path: str) -> int | None:
    """The seq of a listed _lease/ entry, or None when it is no lease record."""
    m = _LEASE.match(basename(path))
    return None if m is None else int(m.group(1))


def staged_requests_path(root: str) -> str:
    """Where an OpenAI batch file's requests are staged as Parquet."""
    return _under(root, STAGED_REQUESTS)


def cancel_path(root: str) -> str:
    """The cancel marker: while it exists, every shard of the job stops."""
    return _under(root, CANCEL)


def success_path(root: str) -> str:
    """The job manifest, committed when every shard is."""
    return _under(root, SUCCESS)


# -- per shard ----------------------------------------------------------------------------------------------------

def results_path(root: str, shard_id: str) -> str:
    """Where a shard's results are committed."""
    return _under(root, f"{RESULTS_DIR}/{shard_id}.parquet")


def accounting_path(root: str, shard_id: str, attempt: int) -> str:
    """Where the accounting row of the attempt that finished a shard is committed."""
    return _under(root, f"{ACCOUNTING_DIR}/{shard_id}.attempt-{attempt:03d}.parquet")


def checkpoints_dir(root: str, shard_id: str) -> str:
    """The folder of a shard's checkpoint parts and markers."""
    return _under(root, f"{CHECKPOINTS_DIR}/{shard_id}")


def part_stem(root: str, shard_id: str, attempt: int, index: int, rows: int) -> str:
    """The path of a checkpoint part without its extension (".parquet" for the part, ".commit" for its marker)."""
    return f"{checkpoints_dir(root, shard_id)}/a{attempt:03d}-p{index:05d}-n{rows}"


def parse_part(path: str) -> tuple[int, int, int, bool] | None:
    """(attempt, index, rows, is_marker) of a listed checkpoint entry, or None when it is neither part nor marker."""
    m = _PART.match(basename(path))
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4) == "commit")


def attempts_dir(root: str, shard_id: str) -> str:
    """The folder of a shard's attempt records."""
    return _under(root, f"{ATTEMPTS_DIR}/{shard_id}")


def start_path(root: str, shard_id: str, attempt: int) -> str:
    """Where attempt `attempt` of the shard records its start."""
    return f"{attempts_dir(root, shard_id)}/attempt-{attempt:03d}.json"


def end_path(root: str, shard_id: str, attempt: int) -> str:
    """Where attempt `attempt` of the shard records how it ended (interrupted or failed)."""
    return f"{attempts_dir(root, shard_id)}/attempt-{attempt:03d}.end.json"


def full_disk_end_path(root: str, shard_id: str, attempt: int, device_s: float) -> str:
    """Where attempt `attempt` records, in the name of an empty file, that it ended on a full disk after holding
    `device_s` device-seconds (its end record could not be written)."""
    return f"{attempts_dir(root, shard_id)}/attempt-{attempt:03d}.end-d{round(device_s * 1000):010d}.json"


def alive_path(root: str, shard_id: str, attempt: int, elapsed_s: float, device_s: float | None = None) -> str:
    """Where attempt `attempt` records that it was running `elapsed_s` seconds after its start, having held
    `device_s` device-seconds (None: not said, as versions before issue 51 wrote)."""
    held = "" if device_s is None else f"-d{round(device_s * 1000):010d}"
    return f"{attempts_dir(root, shard_id)}/attempt-{attempt:03d}.alive-{round(elapsed_s * 1000):010d}{held}.json"


@dataclass(frozen=True)
class AttemptName:
    """What a listed attempts/ entry's name says: `attempt`, `kind`, `elapsed_s` (seconds after the start, alive
    records), `device_s` (device-seconds held: alive records that say it, and full-disk end records)."""

    attempt: int
    kind: RecordKind
    elapsed_s: float | None = None
    device_s: float | None = None


def parse_attempt_name(path: str) -> AttemptName | None:
    """The AttemptName of a listed attempts/ entry, or None when it is no attempt record."""
    m = _ATTEMPT.match(basename(path))
    if m is None:
        return None
    attempt, end, end_ms, alive_ms, alive_dev_ms = m.groups()
    if alive_ms is not None:
        return AttemptName(int(attempt), "alive", int(alive_ms) / 1000,
                           None if alive_dev_ms is None else int(alive_dev_ms) / 1000)
    if end:
        return AttemptName(int(attempt), "end", None, None if end_ms is None else int(end_ms) / 1000)
    return AttemptName(int(attempt), "start")


def parse_attempt_record(path: str) -> tuple[int, RecordKind, float | None] | None:
    """(attempt, kind, seconds after the start for an alive record else None) of a listed attempts/ entry, or None
    when it is no attempt record (parse_attempt_name says more)."""
    name = parse_attempt_name(path)
    return None if name is None else (name.attempt, name.kind, name.elapsed_s)
