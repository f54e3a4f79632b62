"""`tokenmill report`: one self-contained HTML page (plots embedded as SVG) of a job, from what is committed under
OUTPUT: totals (jobs.control.job_status), output tokens/s over time (checkpoint parts: their tokens at their commit
times), tokens per dollar per shard, attempts and preemptions per shard with the device-seconds lost (accounting/),
error rows by reason (results/) and latency spread per shard (the checkpoint parts' latency_s). Tables go through
polars, plots through matplotlib (Agg backend), the page through a jinja2 template with autoescaping.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import jinja2
import matplotlib
import polars as pl

from jobs.control import JobStatus, job_status
from jobs.errors import JobError
from pipeline.accounting import read_committed_accounting
from pipeline.attempts import list_attempts, read_record
from pipeline.checkpoint import committed_parts
from pipeline.layout import results_path, start_path
from pipeline.manifest import read_manifest
from pipeline.storage import exists_now, output_fs, read_table

matplotlib.use("Agg")  # no display: render to SVG in memory
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

MAX_TIME_BINS = 40


@dataclass(frozen=True)
class ReportData:
    """What the page shows, read from OUTPUT: the status (totals), one row per shard (`shards`: shard_id, state,
    rows, rows_error, output_tokens, tokens_per_dollar, attempts, preemptions, gpu_s_lost, gpu_s_billed), the rows
    of the committed results (`results`: shard_id, error), the committed checkpoint parts (`parts`: committed_at in
    seconds since the job's first attempt started, output_tokens) and the latencies of the rows in them
    (`latencies`: shard_id, latency_s; every attempt's rows)."""

    status: JobStatus
    shards: pl.DataFrame
    results: pl.DataFrame
    parts: pl.DataFrame
    latencies: pl.DataFrame


def read_report_data(output_url: str) -> ReportData:
    """Read everything the report shows. Raises JobError (exit 2) when no job started at OUTPUT."""
    status = job_status(output_url)
    manifest = read_manifest(output_url)
    if manifest is None:  # removed since job_status read it
        raise JobError(f"no tokenmill job at {output_url}")
    fs, root = output_fs(output_url)
    shard_rows, result_frames, latency_frames, part_rows = [], [], [], []
    first_start: float | None = None
    for shard in manifest.shards():
        sid = shard.shard_id
        listing = list_attempts(fs, root, sid)
        for a in sorted(listing.started)[:1]:
            started = read_record(fs, start_path(root, sid, a)).get("started_at")
            if started is not None:
                first_start = started if first_start is None else min(first_start, started)
        acc = read_committed_accounting(fs, root, sid) or {}
        shard_rows.append({"shard_id": sid, "state": status.shard_states.get(sid, "pending"),
                           "rows": shard.num_rows, "rows_error": acc.get("rows_error"),
                           "output_tokens": acc.get("output_tokens"), "tokens_per_dollar": acc.get("tokens_per_dollar"),
                           "attempts": acc.get("attempts") or len(listing.started),
                           "preemptions": acc.get("preemptions") or 0, "gpu_s_lost": acc.get("gpu_s_lost") or 0.0,
                           "gpu_s_billed": acc.get("gpu_s_billed")})
        if exists_now(fs, results_path(root, sid)):
            errors = read_table(fs, results_path(root, sid), columns=["error"]).column("error").to_pylist()
            result_frames.append(pl.DataFrame({"shard_id": [sid] * len(errors), "error": errors},
                                              schema={"shard_id": pl.String, "error": pl.String}))
        for part in committed_parts(fs, root, sid):
            table = pl.from_arrow(read_table(fs, part.path))
            if "latency_s" in table.columns:  # parts written before the column existed lack it
                latency_frames.append(table.select(pl.lit(sid).alias("shard_id"), "latency_s").drop_nulls())
            if part.committed_at is not None:
                part_rows.append({"committed_at": part.committed_at,
                                  "output_tokens": int(table["completion_tokens"].sum())})
    parts = pl.DataFrame(part_rows, schema={"committed_at": pl.Float64, "output_tokens": pl.Int64})
    if first_start is not None and parts.height:
        parts = parts.with_columns(pl.col("committed_at") - first_start).sort("committed_at")
    results = (pl.concat(result_frames) if result_frames else
               pl.DataFrame(schema={"shard_id": pl.String, "error": pl.String}))
    latencies = (pl.concat(latency_frames) if latency_frames else
                 pl.DataFrame(schema={"shard_id": pl.String, "latency_s": pl.Float64}))
    return ReportData(status, pl.DataFrame(shard_rows, infer_schema_length=None), results, parts, latencies)


def error_reason(message: str) -> str:
    """An error message reduced to its reason, so rows group: no "line N:" prefix, numbers as N, up to the first
    ';' (where the fix starts)."""
    reason = re.sub(r"^line \d+: ", "", message).split(";")[0]
    return re.sub(r"\d+", "N", reason).strip()[:90]


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()[buf.getvalue().index("<svg"):]  # inline: drop the XML prolog and doctype


def _tokens_over_time(parts: pl.DataFrame) -> str:
    fig, ax = plt.subplots(figsize=(8, 3))
    if parts.height:
        end = max(float(parts["committed_at"].max()), 1e-3)
        width = max(end / MAX_TIME_BINS, 1.0)
        binned = (parts.with_columns((pl.col("committed_at") // width).alias("bin")).group_by("bin")
                  .agg(pl.col("output_tokens").sum()).sort("bin"))
        full = pl.DataFrame({"bin": [float(b) for b in range(int(end // width) + 1)]}).join(binned, on="bin",
                                                                                            how="left").fill_null(0)
        ax.step(full["bin"] * width + width, full["output_tokens"] / width, where="pre", color="tab:blue")
        ax.fill_between(full["bin"] * width + width, full["output_tokens"] / width, step="pre", alpha=0.3)
    ax.set(xlabel="seconds since the job's first attempt", ylabel="output tokens/s (committed)",
           title="Output tokens/s over time")
    return _svg(fig)


def _per_shard_plots(shards: pl.DataFrame) -> tuple[str, str]:
    ids = shards["shard_id"].to_list()
    x = range(len(ids))
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.bar(x, shards["tokens_per_dollar"].fill_null(0).to_list(), color="tab:green")
    ax.set(xticks=list(x), ylabel="output tokens per USD", title="Tokens per dollar per shard")
    ax.set_xticklabels(ids, rotation=30, ha="right", fontsize=8)
    tpd = _svg(fig)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3))
    left.bar([i - 0.2 for i in x], shards["attempts"].to_list(), width=0.4, label="attempts")
    left.bar([i + 0.2 for i in x], shards["preemptions"].to_list(), width=0.4, label="preemptions", color="tab:red")
    left.set(xticks=list(x), title="Attempts and preemptions per shard")
    left.legend()
    right.bar(x, shards["gpu_s_lost"].to_list(), color="tab:red")
    right.set(xticks=list(x), ylabel="device-seconds", title="Device-seconds lost to preemption")
    for a in (left, right):
        a.set_xticklabels(ids, rotation=30, ha="right", fontsize=8)
    return tpd, _svg(fig)


def _errors_plot(results: pl.DataFrame) -> tuple[str, pl.DataFrame]:
    errors = (results.filter(pl.col("error").is_not_null())
              .with_columns(pl.col("error").map_elements(error_reason, return_dtype=pl.String).alias("reason"))
              .group_by("reason").len().sort("len", descending=True))
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.4 * max(errors.height, 1)))
    if errors.height:
        ax.barh(errors["reason"].to_list()[::-1], errors["len"].to_list()[::-1], color="tab:orange")
    else:
        ax.text(0.5, 0.5, "no error rows", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="rows", title="Error rows by reason")
    return _svg(fig), errors


def _latency_plot(latencies: pl.DataFrame) -> str:
    ok = latencies
    fig, ax = plt.subplots(figsize=(8, 3))
    ids = sorted(ok["shard_id"].unique().to_list())
    if ids:
        ax.boxplot([ok.filter(pl.col("shard_id") == s)["latency_s"].to_list() for s in ids], tick_labels=ids)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    else:
        ax.text(0.5, 0.5, "no latencies recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set(ylabel="seconds to the row's last token", title="Latency spread per shard")
    return _svg(fig)


_TEMPLATE = jinja2.Environment(autoescape=True).from_string("""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tokenmill report: {{ st.output }}</title>
<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}
th{background:#f3f3f3}figure{margin:1.5em 0}.state-done{color:#080}.state-failed{color:#b00}</style></head>
<body><h1>tokenmill report</h1>
<p><b>{{ st.output }}</b>: <span class="state-{{ st.state }}" id="state">{{ st.state }}</span>;
input {{ st.input }} (pinned {{ st.started_at }}); report made {{ made }}.</p>
<h2>Totals</h2><table id="totals">{% for k, v in totals %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}
</table>
<figure id="tokens-over-time">{{ svgs.time|safe }}</figure>
<figure id="tokens-per-dollar">{{ svgs.tpd|safe }}</figure>
<figure id="attempts">{{ svgs.attempts|safe }}</figure>
<h2>Shards</h2><table id="shards"><tr>{% for c in shards.columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for row in shards.iter_rows() %}<tr>{% for v in row %}<td>{{ v if v is not none else "" }}</td>{% endfor %}
</tr>{% endfor %}</table>
<figure id="errors">{{ svgs.errors|safe }}</figure>
{% if errors.height %}<table id="error-reasons"><tr><th>reason</th><th>rows</th></tr>
{% for reason, n in errors.iter_rows() %}<tr><td>{{ reason }}</td><td>{{ n }}</td></tr>{% endfor %}</table>{% endif %}
<figure id="latency">{{ svgs.latency|safe }}</figure>
</body></html>
""")


def render_report(output_url: str) -> str:
    """The job's report as one self-contained HTML page (no external files or scripts). Raises JobError (exit 2)
    when no job started at OUTPUT."""
    data = read_report_data(output_url)
    st = data.status
    tpd = st.tokens_per_dollar
    billed = data.shards["gpu_s_billed"].fill_null(0).sum()
    totals = [
        ("shards", ", ".join(f"{n} {state}" for state, n in st.shards.items() if n)),
        ("rows committed / rows", f"{st.rows_committed:,} / {st.rows:,}"),
        ("rows with an error", f"{data.results['error'].is_not_null().sum():,}"),
        ("input / output tokens", f"{st.input_tokens:,} / {st.output_tokens:,}"),
        ("device-seconds billed", f"{billed:,.1f}"),
        ("cost", f"${st.cost_usd:.6f}"),
        ("tokens per dollar", "n/a" if tpd is None else f"{tpd:,.0f}"),
        ("attempts / preemptions", f"{st.attempts} / {st.preemptions}"),
        ("device-seconds lost", f"{st.gpu_s_lost:,.1f}"),
        ("dtype / quantization", f"{', '.join(st.dtypes) or 'n/a'} / {', '.join(st.quantizations) or 'n/a'}"),
    ]
    tpd_svg, attempts_svg = _per_shard_plots(data.shards)
    errors_svg, errors = _errors_plot(data.results)
    svgs = {"time": _tokens_over_time(data.parts), "tpd": tpd_svg, "attempts": attempts_svg, "errors": errors_svg,
            "latency": _latency_plot(data.latencies)}
    shown = data.shards.with_columns(pl.col("tokens_per_dollar").round(0), pl.col("gpu_s_lost").round(3),
                                     pl.col("gpu_s_billed").round(2))
    return _TEMPLATE.render(st=st, totals=totals, shards=shown, errors=errors, svgs=svgs,
                            made=datetime.now(UTC).isoformat(timespec="seconds"))

