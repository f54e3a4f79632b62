"""Progress and summary bookkeeping of a job, without a cluster: event folding, JSON lines, the bill's arithmetic."""

from __future__ import annotations

import json

import pytest

from jobs.cli.run_commands import Reporter
from jobs.summary import JobProgress, JobSummary


def test_progress_tops_finished_shards_up_and_drops_late_events() -> None:
    got: list[tuple[int, int]] = []
    p = JobProgress("run1", lambda r, t: got.append((r, t)))
    p.event((0.0, {"run": "run1", "shard": "00000-000000000", "rows": 3, "tokens": 24}))
    p.event((0.0, {"run": "other-job", "shard": "00000-000000000", "rows": 5, "tokens": 40}))
    p.finish("00000-000000000", rows=8, tokens=61)  # the result came before the last event
    p.event((0.0, {"run": "run1", "shard": "00000-000000000", "rows": 5, "tokens": 37}))  # late: dropped
    p.finish("00000-000000008", rows=4, tokens=30)  # no event at all (a committed shard on a rerun)
    assert got == [(3, 24), (5, 37), (4, 30)]
    assert sum(r for r, _ in got) == 12 and sum(t for _, t in got) == 91


def test_reporter_writes_json_lines_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    rep = Reporter()
    assert not rep.tty  # pytest captures stderr
    rep.start(20)
    rep.update(8, 64)  # first line right away
    rep.update(4, 32)  # within 5 s: held back
    rep.update(8, 64)  # reaches the total: printed
    rep.stop()  # nothing new since: no duplicate
    start, *lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert start == {"event": "start", "rows_total": 20}
    assert [(x["rows_done"], x["output_tokens"]) for x in lines] == [(8, 64), (20, 160)]
    assert all(x["event"] == "progress" and x["rows_total"] == 20 for x in lines)


def test_reporter_draws_a_rich_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    import jobs.cli.run_commands

    screen = io.StringIO()
    monkeypatch.setattr(jobs.cli.run_commands, "err", Console(file=screen, force_terminal=True, width=100))
    rep = Reporter()
    rep.tty = True
    rep.start(10)
    rep.update(10, 80)
    rep.stop()
    assert rep.bar is not None and rep.bar.tasks[0].completed == 10
    assert "10/10" in screen.getvalue() and "out tok/s" in screen.getvalue()


def test_summary_rolls_up_shards_in_tokens_seconds_and_usd() -> None:
    s = JobSummary(shards=3, wall_s=30.0)
    for out_tokens, wall_s in ((100, 10.0), (300, 20.0)):
        s.add({"rows": 10, "rows_ok": 9, "rows_error": 1, "input_tokens": 900, "output_tokens": out_tokens,
               "wall_s": wall_s, "cost_usd": wall_s / 3600 * 2.0})
    s.failed["00001-000000000"] = "ShardError: cannot read"
    d = s.as_dict()
    assert (d["shards_ok"], d["shards_failed"], d["rows_ok"], d["rows_error"]) == (2, 1, 18, 2)
    assert d["output_tokens_per_s"] == pytest.approx(400 / 30.0, abs=0.01)
    assert s.tokens_per_dollar == pytest.approx(400 / (30.0 / 3600 * 2.0))
    assert JobSummary().tokens_per_dollar is None  # nothing billed: undefined, not infinite


def test_summary_lists_the_distinct_dtypes_and_quantizations_the_shards_ran_in() -> None:
    s = JobSummary(shards=4)
    base = {"rows": 1, "rows_ok": 1, "rows_error": 0, "input_tokens": 9, "output_tokens": 4, "wall_s": 1.0,
            "cost_usd": 0.001}
    for dtype, quantization in (("float32", "none"), ("bfloat16", "int8"), ("float32", "none"), (None, None)):
        s.add({**base, "dtype": dtype, "quantization": quantization})  # None: accounting from before the columns
    assert (s.as_dict()["dtypes"], s.as_dict()["quantizations"]) == (["bfloat16", "float32"], ["int8", "none"])
    s.add(base)  # a row read without the keys at all
    assert JobSummary().as_dict()["dtypes"] == [] and s.shards_ok == 5


def test_resumed_rows_count_as_done_but_not_as_this_runs_throughput() -> None:
    """A shard that resumed 12 of its 16 rows from checkpoints (output_tokens 160 in all, 40 generated in 2 s by this
    attempt) reports 40 tokens to the progress stream, not 160: a rerun's first speed was 21,037 tok/s before."""
    from jobs.cluster import generated_tokens

    row = {"rows": 16, "rows_resumed": 12, "output_tokens": 160, "output_tokens_per_s": 20.0, "wall_s": 2.0}
    assert generated_tokens(row) == 40
    got: list[tuple[int, int]] = []
    p = JobProgress("run1", lambda r, t: got.append((r, t)))
    p.finish("00000-000000000", rows=16, tokens=generated_tokens(row))
    assert got == [(16, 40)]


def test_status_and_summary_fold_accounting_rows_alike() -> None:
    """`tokenmill status` and a run's summary total the same accounting rows with one fold (jobs.summary.
    add_accounting): the same tokens, cost, preemptions, time lost, dtypes and quantizations."""
    from jobs.control import JobStatus
    from jobs.summary import add_accounting

    rows = [{"rows": 4, "rows_ok": 4, "rows_error": 0, "input_tokens": 300, "output_tokens": 40, "wall_s": 2.0,
             "cost_usd": 0.001, "attempts": 2, "preemptions": 1, "device_s_lost": 0.5, "dtype": "float32",
             "quantization": "none"},
            {"rows": 3, "rows_ok": 2, "rows_error": 1, "input_tokens": 200, "output_tokens": 30, "wall_s": 1.0,
             "cost_usd": 0.002, "preemptions": None, "device_s_lost": None, "dtype": "bfloat16",
             "quantization": "none"}]
    summary = JobSummary(shards=2)
    status = JobStatus("out", "", 0, "in", "now", {}, 7, 0)
    for row in rows:
        summary.add(row)
        add_accounting(status, row)
    keys = ("input_tokens", "output_tokens", "cost_usd", "preemptions", "device_s_lost", "dtypes", "quantizations")
    assert {k: getattr(status, k) for k in keys} == {k: getattr(summary, k) for k in keys} == {
        "input_tokens": 500, "output_tokens": 70, "cost_usd": pytest.approx(0.003), "preemptions": 1,
        "device_s_lost": 0.5, "dtypes": ["bfloat16", "float32"], "quantizations": ["none"]}
    assert (summary.rows, summary.rows_error, summary.attempts) == (7, 1, 3)
