"""A shard with no row to run (issue 45: every row null, empty or a request error; or every row committed already)
finishes without loading its engine (pipeline.shard_engine.LazyEngine): its error rows and accounting are committed,
0 device-seconds billed, naming the engine the job would load. A shard with one row to run loads it once."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine import EngineConfig, LLMEngine
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.layout import accounting_path, results_path
from pipeline.record import ShardRecord
from pipeline.shard import generate_rows, read_shard, run_shard
from pipeline.shard_engine import EngineFacts, LazyEngine

FINGERPRINT = "sha256:" + "ab" * 32  # the job's pinned model, as jobs.task hands it over
CONFIG = EngineConfig(device="cpu", dtype="float32")  # the session engine's


class Counted:
    """A LazyEngine over the session engine that counts its loads."""

    def __init__(self, engine: LLMEngine, tiny_model: str) -> None:
        self.engine, self.loads = engine, 0
        self.lazy = LazyEngine(self._load, lambda: EngineFacts.planned(tiny_model, CONFIG, FINGERPRINT))

    def _load(self) -> tuple[LLMEngine, str]:
        self.loads += 1
        return self.engine, FINGERPRINT


def _shard(tmp_path: Path, prompts: list[object], messages: bool = False) -> Shard:
    column = "messages" if messages else "prompt"
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))],
                             column: pa.array(prompts, pa.string())}), path)
    return Shard("00000-000000000", str(path), f"file://{path}", 0, len(prompts))


def test_the_planned_facts_are_the_loaded_engines(engine: LLMEngine, tiny_model: str) -> None:
    """What a shard with no row to run writes (model name, device, dtype, quantization) is what the engine the job
    would load says about itself."""
    assert EngineFacts.planned(tiny_model, CONFIG, FINGERPRINT) == EngineFacts.of(engine, FINGERPRINT)


@pytest.mark.parametrize("messages", [False, True], ids=["prompt", "messages"])
def test_a_shard_of_null_and_empty_rows_never_loads_its_engine(messages: bool, engine: LLMEngine, tiny_model: str,
                                                               tmp_path: Path) -> None:
    bad: list[object] = [None, "", "   ", None] if not messages else [None, "not json", json.dumps({"a": 1}), "[]"]
    shard = _shard(tmp_path, bad, messages)
    out = str(tmp_path / "out")
    counted = Counted(engine, tiny_model)
    column = "messages" if messages else "prompt"
    acct = run_shard(counted.lazy, shard, column, out, RunConfig(max_tokens=4, price_per_hour_usd=3.6))

    assert counted.loads == 0
    rows = pq.read_table(results_path(out, shard.shard_id)).to_pylist()
    assert [r["finish_reason"] for r in rows] == ["error"] * 4 and all(r["error"] for r in rows)
    assert {r["model"] for r in rows} == {engine.model_name} and {r["model_fingerprint"] for r in rows} == {
        FINGERPRINT}
    (a,) = pq.read_table(accounting_path(out, shard.shard_id, 1)).to_pylist()
    assert a == acct
    assert (a["rows"], a["rows_ok"], a["rows_error"], a["input_tokens"], a["output_tokens"]) == (4, 0, 4, 0, 0)
    assert a["device_s"] == a["device_s_billed"] == a["cost_usd"] == 0.0 and a["tokens_per_dollar"] is None
    assert (a["device"], a["dtype"], a["quantization"], a["model"], a["model_fingerprint"]) == (
        "cpu", "float32", "none", engine.model_name, FINGERPRINT)


def test_a_shard_with_one_row_to_run_loads_its_engine_once(engine: LLMEngine, tiny_model: str,
                                                          gsm8k_questions: list[str], tmp_path: Path) -> None:
    shard = _shard(tmp_path, [None, gsm8k_questions[40], ""])
    out = str(tmp_path / "out")
    counted = Counted(engine, tiny_model)
    run_shard(counted.lazy, shard, "prompt", out, RunConfig(max_tokens=4))
    assert counted.loads == 1
    rows = pq.read_table(results_path(out, shard.shard_id)).to_pylist()
    assert [r["finish_reason"] for r in rows] == ["error", "length", "error"]
    (a,) = pq.read_table(accounting_path(out, shard.shard_id, 1)).to_pylist()
    assert a["device_s"] > 0 and a["output_tokens"] == 4 and a["model_fingerprint"] == FINGERPRINT


def test_a_shard_whose_rows_are_all_committed_finishes_without_its_engine(engine: LLMEngine, tiny_model: str,
                                                                         gsm8k_questions: list[str],
                                                                         tmp_path: Path) -> None:
    """An attempt that committed every row as checkpoint parts and died before the results: the next attempt only
    merges and commits them; it loads no engine and bills itself 0 s (the dead attempt's time is billed from its
    records)."""
    shard = _shard(tmp_path, gsm8k_questions[50:53])
    out = str(tmp_path / "out")
    cfg = RunConfig(max_tokens=4)
    attempt = ShardRecord.open(out, shard.shard_id).claim(cfg.heartbeat_seconds)
    ckpt = attempt.checkpointer(engine.model_name, every_rows=100, every_s=3600.0, started=0.0,
                                model_fingerprint=FINGERPRINT)
    outputs = generate_rows(engine, read_shard(shard, "prompt", "id"), cfg)
    for k, o in enumerate(outputs):
        ckpt.add(k, o)
    ckpt.commit()  # ... and the attempt is killed here

    counted = Counted(engine, tiny_model)
    a = run_shard(counted.lazy, shard, "prompt", out, cfg)
    assert counted.loads == 0
    assert (a["attempt"], a["rows_resumed"], a["device_s"], a["output_tokens"]) == (2, 3, 0.0, 12)
    rows = pq.read_table(results_path(out, shard.shard_id)).to_pylist()
    assert [r["completion"] for r in rows] == [o.text for o in outputs]
