"""`tokenmill run --dry-run`: the forecast of real GSM8K jobs (Parquet and OpenAI batch JSONL) from the real model,
and nothing written. How close it comes to a real job's device-seconds is a bench figure (bench/forecast.py,
bench/README.md): timings are not asserted here."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from engine.loading.model_files import default_model_path
from engine.text.tokenizer import Tokenizer
from jobs.cli import app
from jobs.formats.openai_batch import CHAT_URL
from jobs.plan.preflight import model_context

runner = CliRunner()


def test_dry_run_forecasts_rows_tokens_and_cost_and_writes_nothing(tmp_path: Path, data_dir: Path,
                                                                   tiny_model: str) -> None:
    rows = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(600, 10)
    src = tmp_path / "in.parquet"
    pq.write_table(rows, src)
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(src), str(out), "--prompt-column", "question", "--max-tokens", "4",
                              "--rows-per-shard", "6", "--price-per-hour", "3.0", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    fc = json.loads(res.stdout.strip().splitlines()[-1])
    assert not out.exists()  # nothing written under OUTPUT
    assert (fc["event"], fc["rows"], fc["shards"], fc["device"]) == ("forecast", 10, 2, "cpu")
    # The quantization the run will use, as its summary says it (the default GGUF's Q4_1 weights kept INT4 or not)
    assert fc["quantization"].split(" ")[0] in ("auto", "none", "int4", "int8") and fc["quantization"]
    # Input tokens: the first shard's prompts through the chat template, its mean per row times the rows.
    tok = Tokenizer.from_gguf(default_model_path())
    first = [len(tok.apply_chat_template([{"role": "user", "content": q}]))
             for q in rows.column("question").to_pylist()[:6]]
    assert fc["input_tokens"] == round(sum(first) / 6 * 10)
    assert fc["input_rows_sampled"] == 6  # an estimate from 6 rows: the table says so (issue 51 item 5)
    assert fc["uncertainty"] >= 0 and fc["load_stretch"] > 0
    table = runner.invoke(app, ["run", str(src), str(out), "--prompt-column", "question", "--max-tokens", "4",
                                "--rows-per-shard", "6", "--dry-run"])
    words = " ".join(w for w in table.stdout.split() if w != "│")  # the table wraps its cells
    assert f"~{fc['input_tokens']:,} (estimated from the 6 rows" in words, table.stdout
    # Greedy answers to math questions run past 4 tokens: the expected output is the max_tokens bound.
    assert fc["output_tokens"] == fc["output_tokens_max"] == 40 and fc["mean_output_tokens_observed"] == 4
    # Step times at the sample's batch (the first shard's 6 rows) and at the worker's: both shards share its one
    # engine, 10 rows at once.
    assert fc["prefill_tokens_per_s"] > 0 and fc["device_s"] > 0 and set(fc["decode_step_s"]) == {"6", "10"}
    assert fc["cost_usd"] == fc["device_s"] / 3600 * 3.0
    assert fc["tokens_per_dollar"] == fc["output_tokens"] / fc["cost_usd"]
    # The preflight's memory numbers (jobs.plan.model_fit) of the job's model: KV bytes per token, the sequences held.
    mem, shape = fc["memory"], model_context(tiny_model)
    size = {"bfloat16": 2, "float32": 4}[fc["dtype"]]
    assert mem["device"] == "cpu" and mem["kv_bytes_per_token"] == 2 * shape["layers"] * shape["kv_heads"] * \
        shape["head_dim"] * size
    assert mem["model_bytes"] > 0 and mem["sequences"] == mem["pool_tokens"] // mem["max_model_len"] >= 1


def test_dry_run_of_a_batch_file_stages_nothing_and_leaves_error_rows_out(tmp_path: Path,
                                                                          gsm8k_questions: list[str]) -> None:
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": CHAT_URL,
                         "body": {"messages": [{"role": "user", "content": q}], "max_tokens": 3}})
             for i, q in enumerate(gsm8k_questions[700:705])] + ['{"custom_id": "broken"']
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(requests), str(out), "--dry-run"])  # the table a person reads
    assert res.exit_code == 0, res.output
    assert not out.exists()
    assert "nothing written" in res.stdout and "device-hours" in res.stdout
    assert "│ rows / shards" in res.stdout and "│ 6 / 1" in res.stdout
    assert "(15)" in res.stdout  # output tokens at most: the rows' own max_tokens 3 x 5; the broken row: none
    assert "│ model on the device" in res.stdout and "KiB per token" in res.stdout
    assert "sequences of" in res.stdout and "at once" in res.stdout  # the fit, in the table (stderr: errors only)


def test_the_forecast_costs_one_resident_engine_per_worker_not_one_per_shard() -> None:
    """The model's arithmetic (no timing): a worker's shards share its engine's batch, so 100,000 one-row shards
    decode 16 rows at a time (jobs.plugin.shard_slots' cap of 16 shards in flight), not one; each shard adds only
    SHARED_SHARD_OVERHEAD_S. Before, each shard was costed alone: 1 row per shard forecast 5.2x what 1,000 did."""
    from jobs.plan.forecast import SHARED_SHARD_OVERHEAD_S, WorkerModel, job_device_s, worker_concurrency

    m = WorkerModel(workers=1, max_num_seqs=256, warmup_s=2.0, run_share=1.0, mean_input_tokens=100.0,
                    mean_output_tokens=50.0, prefill_tokens_per_s=1000.0)

    def step_s(batch: int) -> float:
        return 0.02 + 0.001 * batch

    assert worker_concurrency([1] * 100_000, 1, 256) == 16
    assert worker_concurrency([1000] * 100, 1, 256) == 256
    assert worker_concurrency([32], 1, 256) == 32 and worker_concurrency([1] * 32, 1, 256) == 16
    prefill = 100_000 * 100.0 / 1000.0
    one = job_device_s([1] * 100_000, m, step_s)
    assert one == 2.0 + prefill + 312_500 * step_s(16) + 100_000 * SHARED_SHARD_OVERHEAD_S
    thousand = job_device_s([1000] * 100, m, step_s)
    assert thousand == 2.0 + prefill + 19_532 * step_s(256) + 100 * SHARED_SHARD_OVERHEAD_S
    assert one / thousand < 2.2  # the batch of 16 vs 256 and the per-shard overhead, not one engine per shard
    # Two workers: each warms up and serves half the shards.
    two = job_device_s([1000] * 100, WorkerModel(**{**m.__dict__, "workers": 2}), step_s)
    assert two == 2 * (2.0 + prefill / 2 + 9_766 * step_s(256) + 50 * SHARED_SHARD_OVERHEAD_S)


def test_the_calibration_times_the_device_not_the_machine_s_load(engine, data_dir: Path) -> None:
    """Each engine step also sleeps 0.1 s on the stepping thread: a stand-in for other processes taking the cores
    from it (its wall time grows, its CPU time does not). The calibration's device time leaves that out; its wall
    time, the measure before issue 51 item 5, counted it in full."""
    from engine import SamplingParams
    from jobs.plan import calibration_clock, forecast

    prompts = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["question"]).slice(700, 2).column(
        "question").to_pylist()
    step = type(engine).step

    def loaded_step(self, *args, **kwargs):
        time.sleep(0.1)
        return step(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(engine), "step", loaded_step)
        device_s, outs = forecast._timed(engine, prompts, SamplingParams(max_tokens=5, ignore_eos=True), True)
    wall_s = calibration_clock._CLOCKS[-1][0]
    assert [o.num_output_tokens for o in outs] == [5, 5]
    assert wall_s >= 0.5 and device_s < wall_s - 0.4  # >= 5 steps: >= 0.5 s asleep, none of it device time
