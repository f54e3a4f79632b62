"""`tokenmill report`: the HTML page of a real small job (GSM8K rows, the real model, one shard preempted and
resumed), rendered in headless Chromium (Debian's chromium) to a PNG that must show the plots."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from engine import EngineConfig, LLMEngine
from jobs.cli import app
from jobs.formats.report import error_reason, read_report_data, render_report
from pipeline.config import RunConfig
from pipeline.manifest import pin_manifest
from pipeline.shard import ShardInterrupted, run_shard

runner = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# matplotlib's default colours of the bars and lines the report draws (tab:blue, green, red, orange).
WIDTH, HEIGHT = 1200, 3200
PLOT_COLOURS = {"tokens over time": (31, 119, 180), "tokens per dollar": (44, 160, 44),
                "preemptions and device-seconds lost": (214, 39, 40), "error rows": (255, 127, 14)}


@pytest.fixture()
def preempted_job(tmp_path: Path, data_dir: Path, engine: LLMEngine) -> Path:
    """A finished job of 8 GSM8K rows in 2 shards (one row's prompt null: an error row); shard 1 was stopped by a
    spot notice after its first checkpoint and resumed in a second attempt."""
    t = pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(900, 8)
    questions = t.column("question").to_pylist()
    questions[2] = None
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": t.column("id"), "question": questions}), src)
    out = tmp_path / "out"
    cfg = RunConfig(prompt_column="question", max_tokens=6, rows_per_shard=4, checkpoint_rows=1)
    manifest, _ = pin_manifest(str(out), str(src), cfg)
    s0, s1 = manifest.shards()
    small = engine.with_config(EngineConfig(device="cpu", dtype="float32", max_num_seqs=2,
                                            kv_cache_memory_bytes=128 << 20))
    run_shard(small, s0, "question", str(out), cfg)
    parts = out / "checkpoints" / s1.shard_id
    with pytest.raises(ShardInterrupted):
        run_shard(small, s1, "question", str(out), cfg, should_stop=lambda: any(parts.glob("*.commit")))
    run_shard(small, s1, "question", str(out), cfg)
    return out


def test_error_reasons_group_rows() -> None:
    assert error_reason("line 4: body fields ['tools'] are not supported; remove them") == \
        "body fields ['tools'] are not supported"
    assert error_reason("the prompt has 9000 tokens; at most 8191 fit") == "the prompt has N tokens"


def test_report_renders_the_job_in_headless_chromium(preempted_job: Path, tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the page cannot be rendered")
    data = read_report_data(str(preempted_job))
    shards = {r["shard_id"]: r for r in data.shards.to_dicts()}
    assert [r["preemptions"] for r in shards.values()] == [0, 1] and [r["attempts"] for r in shards.values()] == [1, 2]
    assert data.results.height == 8 and data.results["error"].null_count() == 7
    assert data.latencies.height == 7 and data.latencies["latency_s"].min() > 0  # the rows that ran
    assert data.parts["output_tokens"].sum() >= data.status.output_tokens  # every committed part, both attempts

    page = tmp_path / "report.html"
    res = runner.invoke(app, ["report", str(preempted_job), "--html", str(page)])
    assert res.exit_code == 0, res.output
    html = page.read_text()
    assert "<script" not in html and "src=" not in html  # self-contained: nothing to fetch
    assert len(re.findall(r"<figure id=\"[a-z-]+\"><svg", html)) == 6 and 'class="none"' not in html
    assert re.search(r"<th>rows committed / rows</th><td>8 / 8</td>", html)
    assert re.search(r"<th>attempts / preemptions</th><td>3 / 1</td>", html)
    st = data.status
    assert f"<th>input / output tokens</th><td>{st.input_tokens:,} / {st.output_tokens:,}</td>" in html
    assert "<td>the prompt is null</td><td>1</td>" in html

    image = _screenshot(page, tmp_path / "report.png")
    colours = {c for _, c in image.getcolors(maxcolors=1 << 20)}
    for plot, rgb in PLOT_COLOURS.items():  # the plots' bars and lines are on the rendered page
        assert rgb in colours, f"the {plot} plot is not in the screenshot"
    _assert_nothing_overflows(image)


def _screenshot(page: Path, png: Path) -> Image.Image:
    """The page rendered by headless Chromium in a window 1200 px wide (a laptop's browser), as RGB."""
    shot = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--screenshot={png}", f"--window-size={WIDTH},{HEIGHT}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert png.is_file(), shot.stderr
    image = Image.open(png).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    return image


def _assert_nothing_overflows(image: Image.Image) -> None:
    """The page keeps a white margin at its right edge: no table or plot runs past the window (the shards table
    did, at 1200 px)."""
    strip = image.crop((WIDTH - 30, 0, WIDTH, HEIGHT))
    assert {c for _, c in strip.getcolors(maxcolors=1 << 20)} == {(255, 255, 255)}, "something overflows the page"


def test_report_of_a_job_with_nothing_done_says_so(tmp_path: Path, data_dir: Path) -> None:
    """A job pinned but with no row committed (its first run stopped before any commit): the report used to exit 1
    with a polars traceback (rounding a column of nulls). Now a page that says nothing is done yet, each plot
    the line "<title>: none", no empty frames."""
    src = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(0, 8), src)
    out = tmp_path / "out"
    pin_manifest(str(out), str(src), RunConfig(prompt_column="question", rows_per_shard=4))
    page = tmp_path / "report.html"
    res = runner.invoke(app, ["report", str(out), "--html", str(page)])
    assert res.exit_code == 0, res.output
    html = page.read_text()
    assert "Nothing is done yet: no row of the 8 is committed" in html
    assert "<svg" not in html and len(re.findall(r'<p class="none" id="[a-z-]+"><b>[^<]+</b>: none</p>', html)) == 6
    assert re.search(r"<th>rows committed / rows</th><td>0 / 8</td>", html)
    if CHROMIUM is not None:
        _assert_nothing_overflows(_screenshot(page, tmp_path / "report.png"))


def test_report_says_none_where_a_finished_job_has_nothing_to_plot(tmp_path: Path, data_dir: Path,
                                                                   engine: LLMEngine) -> None:
    """A clean job (no preemption, no error row): "Device-seconds lost to preemption: none" and "Error rows by
    reason: none" instead of empty frames; the other plots are drawn."""
    src = tmp_path / "in.parquet"
    pq.write_table(pq.read_table(data_dir / "gsm8k_test.parquet", columns=["id", "question"]).slice(20, 4), src)
    out = tmp_path / "out"
    cfg = RunConfig(prompt_column="question", max_tokens=4, rows_per_shard=2)
    manifest, _ = pin_manifest(str(out), str(src), cfg)
    for shard in manifest.shards():
        run_shard(engine, shard, "question", str(out), cfg)
    html = render_report(str(out))
    assert '<p class="none" id="lost"><b>Device-seconds lost to preemption</b>: none</p>' in html
    assert '<p class="none" id="errors"><b>Error rows by reason</b>: none</p>' in html
    assert "Nothing is done yet" not in html
    assert re.findall(r'<figure id="([a-z-]+)"><svg', html) == ["tokens-over-time", "tokens-per-dollar", "attempts",
                                                                 "latency"]
