"""The bill of a finished shard: tokens, device-seconds of every attempt (lost ones included), USD.

Earlier attempts are billed from their records (pipeline.attempts, pipeline.checkpoint):
- An attempt that ended on its own (interrupted or failed) wrote its device-seconds in its end record: billed as is.
- One that ended on a full disk wrote its device-seconds in the name of an empty end record instead
  (pipeline.attempts.end_on_full_disk): billed as is, not a preemption.
- One that was killed (SIGKILL, a vanished VM) could not. It is billed the device-seconds its last sign of life says
  it held: the later of its last committed part (the marker's device_s) and its last heartbeat
  (pipeline.attempts.Heartbeat: its device-seconds are in the record's name, so one listing gives them); the shards
  of one killed worker are so billed its time once. Signs written before they said it (elapsed_s and the heartbeat's
  seconds since the start only) bill its start to its last sign of life. That under-bills by less than
  one heartbeat interval (RunConfig.heartbeat_seconds), never over-bills. One killed before its first part or
  heartbeat is billed one heartbeat interval (at most until the next attempt's start): it ran less than that, and
  billing it 0 s dropped its time from every bill. An attempt whose start record has no `heartbeat_s` (written
  before heartbeats existed) is estimated as before: its last part's elapsed time plus the time to the next
  attempt's start, capped at `checkpoint_seconds`.
- Its lost device-seconds (`device_s_lost`) are those after its last commit (the marker's device_s): work no commit
  kept. For an interrupted
  attempt that is only its stop commit; the partial decoding of its in-flight rows is not counted (an estimate).

Shards share a worker's engine (engine.loop.engine_loop: several shards' rows in one batch). An attempt's own
device-seconds (`device_s`, and `device_s` in its end record) are therefore not its wall time but its fair share
(engine.loop.clock.DeviceClock): each engine step's seconds split by the tokens each shard computed in that step
(prefill chunks and decodes), plus the wall time in which the engine ran no step at all (committing, other
shards reading their rows, idle) split equally among the shards in it. An attempt is billed from its claim, made
once its rows are read and it holds the engine (pipeline.shard.run_shard); one with no row to run (every row an error
row found before any engine, or every row committed already) holds no engine and is billed 0 device-seconds.
Shards that overlap for T seconds are billed T in all. A
killed attempt, which cannot write its share, is still billed from its records' wall times as above (an
overestimate when it shared the engine).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from fsspec import AbstractFileSystem

from pipeline.attempts import AttemptListing, read_record
from pipeline.checkpoint import Part
from pipeline.layout import accounting_path, end_path, start_path
from pipeline.storage import exists_now, read_table
from schemas import ACCOUNTING_SCHEMA


@dataclass(frozen=True)
class EarlierAttempts:
    """What the attempts before the finishing one cost.

    Attributes:
        preemptions: attempts that ended without finishing and without failing (interrupted or killed).
        device_s: their device-seconds, estimated for killed ones (seconds).
        device_s_lost: their device-seconds after their last commit (seconds).
    """

    preemptions: int = 0
    device_s: float = 0.0
    device_s_lost: float = 0.0


def _before_first_sign(starts: dict[int, dict[str, Any]], a: int, now: float | None) -> float:
    """Seconds to bill attempt `a`, killed with no sign of life after its start record: one heartbeat interval (a
    live attempt leaves a sign that often), at most until the next attempt's start (or `now`, epoch seconds, for the
    latest one)."""
    bound = float(starts[a]["heartbeat_s"])
    started_at = starts[a].get("started_at")
    after = next((starts[b].get("started_at") for b in sorted(starts) if b > a
                  and starts[b].get("started_at") is not None), now)
    if started_at is not None and after is not None:
        bound = min(bound, max(float(after) - float(started_at), 0.0))
    return bound


def bill_earlier_attempts(fs: AbstractFileSystem, root: str, shard_id: str, attempt: int, listing: AttemptListing,
                          parts: list[Part], checkpoint_seconds: float, now: float | None = None) -> EarlierAttempts:
    """Bill the attempts numbered below `attempt` (see the module docstring for the estimates) in device-seconds.
    Reads each one's start record, end record (if any) and last marker: at most three small objects per earlier
    attempt; which attempts exist and their heartbeats come from `listing` (their names). `now` (epoch seconds)
    bounds the latest attempt's bill when no attempt started after it (pipeline.record.ShardRecord.bill_unfinished);
    None bills it only to its last sign of life."""
    earlier = sorted(a for a in listing.started if a < attempt)
    if not earlier:
        return EarlierAttempts()
    last_part = {p.attempt: p for p in parts}  # parts come sorted: the last one per attempt wins
    starts = {a: read_record(fs, start_path(root, shard_id, a)) for a in listing.started if a <= attempt}
    preemptions, device_s, lost = 0, 0.0, 0.0
    for a in earlier:
        marker = read_record(fs, last_part[a].marker) if a in last_part else {}
        kept = float(marker.get("elapsed_s", 0.0))
        # The device-seconds held at the last commit (older markers say only the wall seconds since the start).
        kept_device = float(marker["device_s"]) if marker.get("device_s") is not None else kept
        if a in listing.full_disk:  # ended on a full disk: its device-seconds are in its record's name
            used = listing.full_disk[a]
            device_s += used
            lost += max(used - kept_device, 0.0)
            continue
        # Read even when `listing` shows no end: an attempt that ended after the listing (a zombie) has one now.
        end = read_record(fs, end_path(root, shard_id, a))
        if end:
            used = float(end.get("device_s", end.get("gpu_s", kept)))  # gpu_s: records written before the rename
            preemptions += end.get("outcome") == "interrupted"
        elif marker.get("device_s") is not None or a in listing.alive_device_s:
            preemptions += 1  # killed: billed the device-seconds its last sign of life says it held
            used = max(kept_device, listing.alive_device_s.get(a, 0.0))
            if used == 0.0:
                used = _before_first_sign(starts, a, now)
        elif starts[a].get("heartbeat_s") is not None:
            preemptions += 1
            used = max(kept, listing.alive.get(a, 0.0))  # start -> last sign of life
            if used == 0.0:  # killed before its first part or heartbeat: it ran for less than one interval
                used = _before_first_sign(starts, a, now)
        else:
            preemptions += 1
            last_at = marker.get("committed_at", starts[a].get("started_at"))
            next_start = next((starts[b].get("started_at") for b in sorted(starts) if b > a
                               and starts[b].get("started_at") is not None), None)
            gap = 0.0 if last_at is None or next_start is None else float(next_start) - float(last_at)
            used = kept + min(max(gap, 0.0), checkpoint_seconds)
        device_s += used
        lost += max(used - kept_device, 0.0)
    return EarlierAttempts(preemptions, device_s, lost)


def device_cost_usd(device_s: float, price_per_hour_usd: float) -> float:
    """USD of `device_s` device-seconds at `price_per_hour_usd` USD per device-hour: the one formula of every bill (a
    shard's accounting row; a failed shard's attempts in a run's summary and in `tokenmill status`, through
    pipeline.record.ShardRecord.unfinished_bill)."""
    return device_s / 3600.0 * price_per_hour_usd


def tokens_per_dollar(output_tokens: int, cost_usd: float) -> float | None:
    """Output tokens (or input tokens, or rows: any count) per USD of device time billed for them; None when nothing
    was billed (cost 0)."""
    return output_tokens / cost_usd if cost_usd > 0 else None


class PerDollar:
    """The per-USD figures of a bill (a job's summary, its status, its forecast): output tokens, input tokens (an
    embed or classify job's measure: it generates none) and rows per USD; None when nothing was (or would be)
    billed. The class mixing it in has `output_tokens`, `input_tokens`, `rows` (counts) and `cost_usd` (USD)."""

    output_tokens: int
    input_tokens: int
    rows: int
    cost_usd: float

    @property
    def tokens_per_dollar(self) -> float | None:
        """Output tokens per USD."""
        return tokens_per_dollar(self.output_tokens, self.cost_usd)

    @property
    def input_tokens_per_dollar(self) -> float | None:
        """Input tokens per USD."""
        return tokens_per_dollar(self.input_tokens, self.cost_usd)

    @property
    def rows_per_dollar(self) -> float | None:
        """Rows per USD."""
        return tokens_per_dollar(self.rows, self.cost_usd)

    def per_dollar(self) -> dict[str, float | None]:
        """The three figures, JSON-ready (rounded to 0.1), by name."""
        return {k: None if v is None else round(v, 1) for k, v in (
            ("tokens_per_dollar", self.tokens_per_dollar), ("input_tokens_per_dollar", self.input_tokens_per_dollar),
            ("rows_per_dollar", self.rows_per_dollar))}


def ran_prompt_tokens(results: pa.Table) -> int:
    """Prompt tokens of the rows that ran (error null): an error row's prompt was never computed, though its
    prompt_tokens says how long it was (an over-long prompt's real length)."""
    ran = pc.is_null(results.column("error"))
    return int(pc.sum(pc.filter(results.column("prompt_tokens"), ran)).as_py() or 0)


def ran_images(results: pa.Table) -> int | None:
    """Images in the prompts of the rows that ran (error null); None for results without an `images` column
    (written before it existed, or an embed job's)."""
    if "images" not in results.column_names:
        return None
    ran = pc.is_null(results.column("error"))
    return int(pc.sum(pc.filter(results.column("images"), ran)).as_py() or 0)


def quantization_label(mode: str, loaded: str | None) -> str:
    """The accounting's quantization value: the engine's mode (none, auto, int4, int8), then, for an already
    quantized model, how its layers were loaded in parentheses (LLMEngine.quantization_loaded), e.g. "auto (gptq
    4-bit, group 128: 224 layers INT4 as stored, 0 dequantized exactly)"."""
    return mode if not loaded else f"{mode} ({loaded})"


def accounting_row(*, shard_id: str, attempt: int, input_path: str, row_start: int, results: pa.Table,
                   wall_s: float, generated_tokens: int, device_s: float, earlier: EarlierAttempts, rows_resumed: int,
                   kv_preemptions: int, device: str, dtype: str, quantization: str, model: str,
                   price_per_hour_usd: float, model_fingerprint: str | None = None) -> dict[str, Any]:
    """One schemas.ACCOUNTING_SCHEMA row for the attempt that finished the shard.

    `results`: the committed results (what the bill describes); `wall_s`: this attempt's generation time (seconds);
    `generated_tokens`: output tokens this attempt generated; `device_s`: this attempt's device-seconds. The cost bills
    every attempt's device-seconds (`device_s + earlier.device_s`, in `device_s_billed`): lost time is real money.
    `device`, `dtype` ("bfloat16", "float32", ...: what ran, "auto" resolved) and `quantization` (none, auto, int4,
    int8, with the load report of a quantized model: quantization_label) say what the engine that finished the
    shard ran on and in; `model_fingerprint` which model it had loaded (pipeline.model_pin; None when the job pinned
    none).
    """
    rows = results.num_rows
    errors = rows - results.column("error").null_count
    # An embed job's results have no completion_tokens: it writes no output tokens.
    out_tokens = (int(pc.sum(results.column("completion_tokens")).as_py() or 0)
                  if "completion_tokens" in results.column_names else 0)
    in_tokens = ran_prompt_tokens(results)
    billed = device_s + earlier.device_s
    cost = device_cost_usd(billed, price_per_hour_usd)
    return {
        "shard_id": shard_id, "attempt": attempt, "input_path": input_path, "row_start": row_start,
        "row_end": row_start + rows, "rows": rows, "rows_ok": rows - errors, "rows_error": errors,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "wall_s": wall_s, "output_tokens_per_s": generated_tokens / wall_s if wall_s > 0 else 0.0,
        "device": device, "dtype": dtype, "quantization": quantization, "price_per_hour_usd": price_per_hour_usd,
        "cost_usd": cost, "tokens_per_dollar": tokens_per_dollar(out_tokens, cost),
        "attempts": attempt, "preemptions": earlier.preemptions, "device_s": device_s,
        "device_s_lost": earlier.device_s_lost, "device_s_billed": billed, "rows_resumed": rows_resumed,
        "kv_preemptions": kv_preemptions, "model": model,
        "model_fingerprint": model_fingerprint, "finished_at": datetime.now(UTC), "generated_tokens": generated_tokens,
        "input_tokens_per_dollar": tokens_per_dollar(in_tokens, cost), "rows_per_dollar": tokens_per_dollar(rows, cost),
        "images": ran_images(results),
    }


# Accounting columns renamed since (issue 31: they hold device-seconds, CPU included): an OUTPUT written before reads
# under the new names.
OLD_NAMES = {"gpu_s": "device_s", "gpu_s_lost": "device_s_lost", "gpu_s_billed": "device_s_billed"}


def committed_accounting_of(fs: AbstractFileSystem, root: str, shard_id: str,
                            attempts: Iterable[int]) -> dict[str, Any] | None:
    """The accounting row of the latest of `attempts` (attempt numbers, e.g. one listing's) that committed one, or
    None; the caller checked that the results are committed. Columns written under their old names (OLD_NAMES)
    read under the new ones."""
    # The finishing attempt is nearly always the latest claimed: one exists() per shard, not a listing of accounting/.
    for attempt in sorted(attempts, reverse=True):
        path = accounting_path(root, shard_id, attempt)
        if exists_now(fs, path):
            row = {OLD_NAMES.get(k, k): v for k, v in read_table(fs, path).to_pylist()[-1].items()}
            # A file written before a column was added (dtype, quantization) lacks it: read as null.
            return {name: row.get(name) for name in ACCOUNTING_SCHEMA.names} | row
    return None

