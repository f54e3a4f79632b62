"""`tokenmill report`: one self-contained HTML page (plots embedded as SVG) of a job, from what is committed under
OUTPUT: totals (jobs.control.job_status), output tokens/s over time (checkpoint parts: their tokens at their commit
times), tokens per dollar per shard (an embed, classify or score job, which generates no tokens: input tokens/s over
time, input tokens per dollar per shard, and rows per dollar beside them), attempts and preemptions per shard with the
device-seconds lost (accounting/), error rows by reason (results/) and latency spread per shard (the checkpoint
parts' latency_s). Tables go through polars, plots through matplotlib (Agg backend), the page through a jinja2
template with autoescaping.
"""

from __future__ import annotations

import functools
import io
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import jinja2
import markupsafe
import polars as pl

from jobs.control import JobStatus, job_status
from jobs.errors import JobError
from pipeline.manifest import read_manifest
from pipeline.record import ShardRecord
from pipeline.storage import read_fs

MAX_TIME_BINS = 40
# The per-shard table's columns and types: fixed, so a job with nothing committed (every value null) is still a
# table of numbers, not of polars' null dtype.
SHARD_SCHEMA = {"shard_id": pl.String, "state": pl.String, "rows": pl.Int64, "rows_error": pl.Int64,
                "output_tokens": pl.Int64, "tokens_per_dollar": pl.Float64, "input_tokens": pl.Int64,
                "input_tokens_per_dollar": pl.Float64, "rows_per_dollar": pl.Float64, "attempts": pl.Int64,
                "preemptions": pl.Int64, "device_s_lost": pl.Float64, "device_s_billed": pl.Float64}
# The per-shard columns that measure a task: a generate job's output tokens, an embed, classify or score job's input
# tokens and rows (it generates none); the page's shards table leaves the other task's out.
_TASK_COLUMNS = {"generate": ("output_tokens", "tokens_per_dollar"),
                 "embed": ("input_tokens", "input_tokens_per_dollar", "rows_per_dollar")}


@dataclass(frozen=True)
class ReportData:
    """What the page shows, read from OUTPUT: the status (totals), one row per shard (`shards`: SHARD_SCHEMA's
    columns: tokens, USD, device-seconds), the rows of the committed results (`results`: shard_id, error), the
    committed checkpoint parts (`parts`: committed_at in seconds since the job's first attempt started,
    output_tokens, input_tokens) and the latencies of the rows in them (`latencies`: shard_id, latency_s; every
    attempt's rows). `task`: generate, or embed for an embed, classify or score job (its parts hold no completion)."""

    status: JobStatus
    shards: pl.DataFrame
    results: pl.DataFrame
    parts: pl.DataFrame
    latencies: pl.DataFrame
    task: str = "generate"


def read_report_data(output_url: str) -> ReportData:
    """Read everything the report shows. Raises JobError (exit 2) when no job started at OUTPUT."""
    status = job_status(output_url)
    manifest = read_manifest(output_url)
    if manifest is None:  # removed since job_status read it
        raise JobError(f"no tokenmill job at {output_url}")
    fs, root = read_fs(output_url)
    shard_rows, result_frames, latency_frames, part_rows = [], [], [], []
    first_start: float | None = None
    task = "generate"
    for shard in manifest.shards():
        sid = shard.shard_id
        record = ShardRecord(fs, root, sid)
        listing = record.attempts
        for a in sorted(listing.started)[:1]:
            started = record.start_record(a).get("started_at")
            if started is not None:
                first_start = started if first_start is None else min(first_start, started)
        acc = record.accounting or {}
        shard_rows.append({"shard_id": sid, "state": status.shard_states.get(sid, "pending"),
                           "rows": shard.num_rows, "rows_error": acc.get("rows_error"),
                           **{k: acc.get(k) for k in ("output_tokens", "tokens_per_dollar", "input_tokens",
                                                      "input_tokens_per_dollar", "rows_per_dollar")},
                           "attempts": acc.get("attempts") or len(listing.started),
                           "preemptions": acc.get("preemptions") or 0, "device_s_lost": acc.get("device_s_lost") or 0.0,
                           "device_s_billed": acc.get("device_s_billed")})
        if record.results_committed:
            errors = record.results(columns=["error"]).column("error").to_pylist()
            result_frames.append(pl.DataFrame({"shard_id": [sid] * len(errors), "error": errors},
                                              schema={"shard_id": pl.String, "error": pl.String}))
        for part in record.parts:
            table = pl.from_arrow(record.read_part(part))
            if "latency_s" in table.columns:  # parts written before the column existed lack it
                latency_frames.append(table.select(pl.lit(sid).alias("shard_id"), "latency_s").drop_nulls())
            if "completion_tokens" not in table.columns:  # an embed, classify or score job's part: no output tokens
                task = "embed"
            if part.committed_at is not None:
                part_rows.append({"committed_at": part.committed_at, "input_tokens": int(table["prompt_tokens"].sum()),
                                  "output_tokens": int(table["completion_tokens"].sum()) if task == "generate" else 0})
    parts = pl.DataFrame(part_rows, schema={"committed_at": pl.Float64, "output_tokens": pl.Int64,
                                            "input_tokens": pl.Int64})
    if first_start is not None and parts.height:
        parts = parts.with_columns(pl.col("committed_at") - first_start).sort("committed_at")
    results = (pl.concat(result_frames) if result_frames else
               pl.DataFrame(schema={"shard_id": pl.String, "error": pl.String}))
    latencies = (pl.concat(latency_frames) if latency_frames else
                 pl.DataFrame(schema={"shard_id": pl.String, "latency_s": pl.Float64}))
    return ReportData(status, pl.DataFrame(shard_rows, schema=SHARD_SCHEMA), results, parts, latencies, task)


def error_reason(message: str) -> str:
    """An error message reduced to its reason, so rows group: no "line N:" prefix, numbers as N, up to the first
    ';' (where the fix starts)."""
    reason = re.sub(r"^line \d+: ", "", message).split(";")[0]
    return re.sub(r"\d+", "N", reason).strip()[:90]


@functools.cache
def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display: plots render to SVG in memory), imported on the first plot:
    its import takes about 0.45 s, which only rendering a page should pay, not every importer of error_reason."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()[buf.getvalue().index("<svg"):]  # inline: drop the XML prolog and doctype


def _tokens_over_time(parts: pl.DataFrame, column: str = "output_tokens", title: str = "") -> str | None:
    """Committed tokens/s over time (`column`: output_tokens, or an embed job's input_tokens; `title`: the plot's,
    TITLES' by default); None when no checkpoint part is committed."""
    if not parts.height:
        return None
    fig, ax = _pyplot().subplots(figsize=(8, 3))
    end = max(float(parts["committed_at"].max()), 1e-3)
    width = max(end / MAX_TIME_BINS, 1.0)
    binned = (parts.with_columns((pl.col("committed_at") // width).alias("bin")).group_by("bin")
              .agg(pl.col(column).sum()).sort("bin"))
    full = pl.DataFrame({"bin": [float(b) for b in range(int(end // width) + 1)]}).join(binned, on="bin",
                                                                                        how="left").fill_null(0)
    ax.step(full["bin"] * width + width, full[column] / width, where="pre", color="tab:blue")
    ax.fill_between(full["bin"] * width + width, full[column] / width, step="pre", alpha=0.3)
    ax.set(xlabel="seconds since the job's first attempt", ylabel=f"{column.replace('_', ' ')}/s (committed)",
           title=title or TITLES["tokens-over-time"])
    return _svg(fig)


def _per_shard_bars(shards: pl.DataFrame, title: str, ylabel: str, bars: list[tuple[str, str, str]]) -> str | None:
    """Bars per shard of the columns `bars` ((column, label, colour), side by side); None when every value is 0 or
    null: an empty frame says nothing, the page says "none" instead."""
    if not any(shards[c].fill_null(0).sum() for c, _, _ in bars):
        return None
    ids = shards["shard_id"].to_list()
    fig, ax = _pyplot().subplots(figsize=(8, 3))
    width = 0.8 / len(bars)
    for k, (column, label, colour) in enumerate(bars):
        ax.bar([i + (k - (len(bars) - 1) / 2) * width for i in range(len(ids))], shards[column].fill_null(0).to_list(),
               width=width, label=label, color=colour)
    ax.set(xticks=list(range(len(ids))), ylabel=ylabel, title=title)
    ax.set_xticklabels(ids, rotation=30, ha="right", fontsize=8)
    if len(bars) > 1:
        ax.legend()
    return _svg(fig)


def _errors_plot(results: pl.DataFrame) -> tuple[str | None, pl.DataFrame]:
    """Error rows by reason (bars) and the table of them; no plot when no row is an error."""
    errors = (results.filter(pl.col("error").is_not_null())
              .with_columns(pl.col("error").map_elements(error_reason, return_dtype=pl.String).alias("reason"))
              .group_by("reason").len().sort("len", descending=True))
    if not errors.height:
        return None, errors
    fig, ax = _pyplot().subplots(figsize=(8, 0.6 + 0.4 * errors.height))
    ax.barh(errors["reason"].to_list()[::-1], errors["len"].to_list()[::-1], color="tab:orange")
    ax.set(xlabel="rows", title=TITLES["errors"])
    return _svg(fig), errors


def _latency_plot(latencies: pl.DataFrame) -> str | None:
    """Latency spread per shard (box plots); None when no latency is recorded."""
    ids = sorted(latencies["shard_id"].unique().to_list())
    if not ids:
        return None
    fig, ax = _pyplot().subplots(figsize=(8, 3))
    ax.boxplot([latencies.filter(pl.col("shard_id") == s)["latency_s"].to_list() for s in ids], tick_labels=ids)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.set(ylabel="seconds to the row's last token", title=TITLES["latency"])
    return _svg(fig)


# Each plot of the page: its element id and title. A plot with nothing to show is one line "<title>: none".
TITLES = {"tokens-over-time": "Output tokens/s over time", "tokens-per-dollar": "Tokens per dollar per shard",
          "attempts": "Attempts and preemptions per shard", "lost": "Device-seconds lost to preemption",
          "errors": "Error rows by reason", "latency": "Latency spread per shard"}
# An embed, classify or score job's titles where they differ (it generates no output tokens).
_EMBED_TITLES = {**TITLES, "tokens-over-time": "Input tokens/s over time",
                 "tokens-per-dollar": "Input tokens per dollar per shard"}


# Column headers of the shards table that differ from the column name with spaces (headers wrap: the table fits).
_HEADERS = {"shard_id": "shard", "rows_error": "error rows", "tokens_per_dollar": "tokens per USD",
            "input_tokens_per_dollar": "input tokens per USD", "rows_per_dollar": "rows per USD",
            "device_s_lost": "device-s lost", "device_s_billed": "device-s billed"}


def _cell(value: Any) -> str:
    """A table cell: empty for null, thousands separators for numbers (floats to 2 decimals below 100, else 0)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


_TEMPLATE = jinja2.Environment(autoescape=True).from_string("""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tokenmill report: {{ st.output }}</title>
<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f3f3f3}#shards td,#shards th{text-align:right}#shards td:first-child,#shards th:first-child,
#shards td:nth-child(2){text-align:left;white-space:nowrap}.scroll{max-width:100%;overflow-x:auto}
figure{margin:1.5em 0}svg{max-width:100%;height:auto}.none{color:#555}.notice{background:#fff6d5;padding:.6em 1em;
border:1px solid #e6d48a}.state-done{color:#080}.state-failed{color:#b00}</style></head>
<body><h1>tokenmill report</h1>
<p><b>{{ st.output }}</b>: <span class="state-{{ st.state }}" id="state">{{ st.state }}</span>;
input {{ st.input }} (pinned {{ st.started_at }}); report made {{ made }}.</p>
{% if not st.rows_committed %}<p class="notice" id="nothing-done">
Nothing is done yet: no row of the {{ st.rows }} is committed.
Run or resume the job (<code>tokenmill run</code> / <code>tokenmill submit</code>, the same command) and make the report
again once shards commit.</p>{% endif %}
<h2>Totals</h2><table id="totals">{% for k, v in totals %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}
</table>
{{ plot("tokens-over-time") }}{{ plot("tokens-per-dollar") }}{{ plot("attempts") }}{{ plot("lost") }}
<h2>Shards</h2><div class="scroll"><table id="shards"><tr>{% for c in shards.columns %}<th>{{ header(c) }}</th>
{% endfor %}</tr>
{% for row in shards.iter_rows() %}<tr>{% for v in row %}<td>{{ cell(v) }}</td>{% endfor %}</tr>{% endfor %}
</table></div>
{{ plot("errors") }}
{% if errors.height %}<table id="error-reasons"><tr><th>reason</th><th>rows</th></tr>
{% for reason, n in errors.iter_rows() %}<tr><td>{{ reason }}</td><td>{{ n }}</td></tr>{% endfor %}</table>{% endif %}
{{ plot("latency") }}
</body></html>
""")
_PLOT = jinja2.Environment(autoescape=True).from_string(
    '{% if svg %}<figure id="{{ id }}">{{ svg|safe }}</figure>{% else %}<p class="none" id="{{ id }}"><b>{{ title }}'
    '</b>: none</p>{% endif %}\n')


def render_report(output_url: str) -> str:
    """The job's report as one self-contained HTML page (no external files or scripts). A job with nothing
    committed yet gets a page that says so; a plot with nothing to show is the line "<title>: none". Raises
    JobError (exit 2) when no job started at OUTPUT."""
    data = read_report_data(output_url)
    st = data.status
    billed = data.shards["device_s_billed"].fill_null(0).sum()
    generate = data.task == "generate"
    titles = TITLES if generate else _EMBED_TITLES

    def per_usd(value: float | None) -> str:
        return "n/a" if value is None else f"{value:,.0f}"
    totals = [
        ("shards", ", ".join(f"{n} {state}" for state, n in st.shards.items() if n)),
        ("rows committed / rows", f"{st.rows_committed:,} / {st.rows:,}"),
        ("rows with an error", f"{data.results['error'].is_not_null().sum():,}"),
        ("input / output tokens", f"{st.input_tokens:,} / {st.output_tokens:,}") if generate
        else ("input tokens", f"{st.input_tokens:,}"),
        ("device-seconds billed", f"{billed:,.1f}"),
        ("cost", f"${st.cost_usd:.6f}"),
        ("tokens per dollar", per_usd(st.tokens_per_dollar)) if generate else
        ("input tokens / rows per dollar", f"{per_usd(st.input_tokens_per_dollar)} / {per_usd(st.rows_per_dollar)}"),
        ("attempts / preemptions", f"{st.attempts} / {st.preemptions}"),
        ("device-seconds lost", f"{st.device_s_lost:,.1f}"),
        ("dtype / quantization", f"{', '.join(st.dtypes) or 'n/a'} / {', '.join(st.quantizations) or 'n/a'}"),
    ]
    other = _TASK_COLUMNS["embed" if generate else "generate"]
    shards = data.shards.drop(other)
    errors_svg, errors = _errors_plot(data.results)
    tokens, per_dollar = ("output_tokens", "tokens_per_dollar") if generate else ("input_tokens",
                                                                                 "input_tokens_per_dollar")
    svgs = {"tokens-over-time": _tokens_over_time(data.parts, tokens, titles["tokens-over-time"]),
            "tokens-per-dollar": _per_shard_bars(shards, titles["tokens-per-dollar"],
                                                 f"{tokens.replace('_', ' ')} per USD",
                                                 [(per_dollar, f"{tokens.split('_')[0]} tokens per USD", "tab:green")]),
            "attempts": _per_shard_bars(shards, TITLES["attempts"], "count",
                                        [("attempts", "attempts", "tab:blue"),
                                         ("preemptions", "preemptions", "tab:red")]),
            "lost": _per_shard_bars(shards, TITLES["lost"], "device-seconds",
                                    [("device_s_lost", "device-seconds lost", "tab:red")]),
            "errors": errors_svg, "latency": _latency_plot(data.latencies)}

    def plot(name: str) -> str:
        return markupsafe.Markup(_PLOT.render(id=name, title=titles[name], svg=svgs[name]))

    return _TEMPLATE.render(st=st, totals=totals, shards=shards, errors=errors, plot=plot, cell=_cell,
                            header=lambda c: _HEADERS.get(c, c.replace("_", " ")),
                            made=datetime.now(UTC).isoformat(timespec="seconds"))
