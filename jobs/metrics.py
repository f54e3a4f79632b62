"""Job-level Prometheus metrics (prometheus-client): pushed to a Pushgateway and/or written to a node_exporter textfile.

A job is a batch: nothing scrapes it while it runs, so it pushes. With TOKENMILL_PUSHGATEWAY_URL set
(http://pushgateway:9091), a run pushes its progress every TOKENMILL_METRICS_INTERVAL_S seconds (default 15) and its
totals when it ends, in the group job=<job name>; with --metrics-file it writes the same series to a file for
node_exporter's textfile collector (cron hosts; the file is replaced atomically). Every series has the label
`model`. The job name is TOKENMILL_JOB_NAME, else the last part of OUTPUT.

Series (units in the name; *_total are counters holding the job's totals over its committed shards):
    tokenmill_rows_planned, tokenmill_rows_done           rows of the job; rows finished so far (progress)
    tokenmill_rows_total{status="ok"|"error"}             committed rows
    tokenmill_input_tokens_total, tokenmill_output_tokens_total
    tokenmill_output_tokens_per_second                    of the run's wall time (live while it runs)
    tokenmill_device_seconds_billed_total                 every attempt, lost time included
    tokenmill_device_seconds_lost_total                   device-seconds no commit kept (preemptions)
    tokenmill_cost_usd_total, tokenmill_tokens_per_dollar
    tokenmill_attempts_total, tokenmill_preemptions_total
    tokenmill_shards{state="ok"|"failed"|"stopped"}
    tokenmill_last_success_timestamp_seconds              when the job last finished every shard (unix time)

Pushes add to the group (POST), so a failed run leaves the last success time of an earlier one. A push that fails
is logged and never fails the job. Dask's own /metrics (scheduler and workers) stays available beside these.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import PurePosixPath

from prometheus_client import CollectorRegistry, Counter, Gauge, pushadd_to_gateway, write_to_textfile

from engine.loading.model_files import DEFAULT_MODEL_FILE
from jobs.summary import JobSummary
from schemas import settings

log = logging.getLogger(__name__)

PUSHGATEWAY_ENV = settings.PUSHGATEWAY_URL
INTERVAL_ENV = settings.METRICS_INTERVAL_S
JOB_NAME_ENV = settings.JOB_NAME
DEFAULT_INTERVAL_S = 15.0
PUSH_TIMEOUT_S = 5.0
LAST_SUCCESS = "tokenmill_last_success_timestamp_seconds"


def job_name(output_url: str) -> str:
    """TOKENMILL_JOB_NAME, else the last part of OUTPUT (s3://bucket/jobs/nightly/ -> nightly)."""
    return settings.env_text(JOB_NAME_ENV) or PurePosixPath(output_url.rstrip("/")).name or "tokenmill"


def model_label(model: str | None) -> str:
    """The model's file (or folder) name, as the accounting's `model` column names it."""
    return PurePosixPath(model.rstrip("/")).name if model else DEFAULT_MODEL_FILE


class JobMetrics:
    """The Prometheus series of one run of a job, pushed and/or written as the run goes.

    Args:
        job: the job name (the Pushgateway's `job` grouping label).
        model: the `model` label.
        pushgateway_url: Pushgateway address (http://host:9091); None = no pushes.
        metrics_file: node_exporter textfile path (local, *.prom); None = no file.
        interval_s: seconds between progress publications (>= 0; 0 = at every progress report).

    Raises ValueError for a negative interval or a metrics file that does not end in .prom (node_exporter's
    textfile collector reads only those).
    """

    def __init__(self, job: str, model: str, *, pushgateway_url: str | None = None, metrics_file: str | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if interval_s < 0:
            raise ValueError(f"the metrics interval must be >= 0 seconds, got {interval_s}")
        if metrics_file is not None and not metrics_file.endswith(".prom"):
            raise ValueError(f"--metrics-file {metrics_file!r} must end in .prom: node_exporter's textfile collector "
                             "reads only *.prom files")
        self.job, self.pushgateway_url, self.metrics_file = job, pushgateway_url, metrics_file
        self.interval_s = interval_s
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model"]
        self.rows_planned = Gauge("tokenmill_rows_planned", "Rows of the job.", labels, registry=r).labels(model)
        self.rows_done = Gauge("tokenmill_rows_done", "Rows finished so far.", labels, registry=r).labels(model)
        self.tokens_per_s = Gauge("tokenmill_output_tokens_per_second", "Output tokens per second of the run's wall "
                                  "time.", labels, registry=r).labels(model)
        rows = Counter("tokenmill_rows", "Committed rows, by status.", [*labels, "status"], registry=r)
        self.rows_ok, self.rows_error = rows.labels(model, "ok"), rows.labels(model, "error")
        self.totals = {name: Counter(f"tokenmill_{name}", doc, labels, registry=r).labels(model) for name, doc in [
            ("input_tokens", "Prompt tokens of committed rows."),
            ("output_tokens", "Completion tokens of committed rows."),
            ("device_seconds_billed", "Device-seconds billed: every attempt of every shard, lost time included."),
            ("device_seconds_lost", "Device-seconds of work no commit kept (preempted attempts)."),
            ("cost_usd", "Cost of the device-seconds billed, USD."),
            ("attempts", "Shard attempts."), ("preemptions", "Shard attempts that ended without finishing.")]}
        self.tokens_per_dollar = Gauge("tokenmill_tokens_per_dollar", "Output tokens per USD billed.", labels,
                                       registry=r).labels(model)
        shards = Gauge("tokenmill_shards", "Shards, by state.", [*labels, "state"], registry=r)
        self.shards = {s: shards.labels(model, s) for s in ("ok", "failed", "stopped")}
        self.last_success = Gauge(LAST_SUCCESS, "When the job last finished every "
                                  "shard, unix time.", labels, registry=r).labels(model)
        self._planned = self._done = self._tokens = 0
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, output_url: str, model: str | None, metrics_file: str | None = None) -> JobMetrics | None:
        """The job's metrics as the environment asks (TOKENMILL_PUSHGATEWAY_URL, TOKENMILL_METRICS_INTERVAL_S,
        TOKENMILL_JOB_NAME) plus `metrics_file`; None when neither a Pushgateway nor a file is asked for.
        Raises ValueError for a bad interval or file name."""
        url = settings.env_text(PUSHGATEWAY_ENV)
        if url is None and metrics_file is None:
            return None
        return cls(job_name(output_url), model_label(model), pushgateway_url=url, metrics_file=metrics_file,
                   interval_s=settings.env_seconds(INTERVAL_ENV, DEFAULT_INTERVAL_S, allow_zero=True))

    def start(self, rows: int) -> None:
        """The run starts: the job has `rows` rows. Publishes at once."""
        self._t0 = time.perf_counter()
        self._planned = rows
        self.rows_planned.set(rows)
        self.publish()

    def progress(self, rows: int, tokens: int) -> None:
        """`rows` more rows finished with `tokens` output tokens; publishes when the interval has passed."""
        with self._lock:
            self._done += rows
            self.rows_done.set(self._done)
            self._tokens += tokens
            self.tokens_per_s.set(self._tokens / max(time.perf_counter() - self._t0, 1e-9))
            due = time.perf_counter() - self._last >= self.interval_s
        if due:
            self.publish()

    def finish(self, summary: JobSummary) -> None:
        """The run ended with `summary` (the job's totals over its committed shards): set every series, publish."""
        with self._lock:
            self.rows_planned.set(max(summary.rows, self._planned))
            self.rows_done.set(max(summary.rows, self._done))
            self.rows_ok.inc(summary.rows_ok)
            self.rows_error.inc(summary.rows_error)
            for name, value in [("input_tokens", summary.input_tokens), ("output_tokens", summary.output_tokens),
                                ("device_seconds_billed", summary.device_s), ("device_seconds_lost",
                                                                              summary.device_s_lost),
                                ("cost_usd", summary.cost_usd), ("attempts", summary.attempts),
                                ("preemptions", summary.preemptions)]:
                self.totals[name].inc(value)
            if not summary.already_done:
                self.tokens_per_s.set(summary.output_tokens_per_s)
            self.tokens_per_dollar.set(summary.tokens_per_dollar or 0.0)
            for state, n in [("ok", summary.shards_ok), ("failed", len(summary.failed)),
                             ("stopped", len(summary.stopped))]:
                self.shards[state].set(n)
            succeeded = summary.shards_ok == summary.shards and not summary.failed and not summary.stopped
            if succeeded and not summary.already_done:
                self.last_success.set(time.time())
        self.publish(with_last_success=succeeded and not summary.already_done)

    def publish(self, with_last_success: bool = False) -> None:
        """Push to the Pushgateway and write the textfile now. A failed push or write is logged, not raised.
        The last-success series goes out only when `with_last_success` (a push adds to the group, so an earlier
        run's success time stays)."""
        self._last = time.perf_counter()
        registry = self.registry if with_last_success else _Without(self.registry, LAST_SUCCESS)
        if self.pushgateway_url:
            try:
                pushadd_to_gateway(self.pushgateway_url, job=self.job, registry=registry, timeout=PUSH_TIMEOUT_S)
            except OSError as e:
                log.warning("could not push metrics to %s: %s", self.pushgateway_url, e)
        if self.metrics_file:
            try:
                write_to_textfile(self.metrics_file, registry)
            except OSError as e:
                log.warning("could not write metrics to %s: %s", self.metrics_file, e)

class _Without:
    """A view of a registry without one metric family."""

    def __init__(self, registry: CollectorRegistry, leave_out: str) -> None:
        self.registry, self.leave_out = registry, leave_out

    def collect(self):  # prometheus_client's Collector protocol
        return [m for m in self.registry.collect() if m.name != self.leave_out]
