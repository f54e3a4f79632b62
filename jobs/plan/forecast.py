"""What a job will cost before it runs (`tokenmill run ... --dry-run`): rows, tokens, device-hours and USD.

The forecast plans the job's shards from its input as a first start would (pipeline.manifest.build_manifest: it lists
and reads footers, writes nothing), tokenizes the rows of its first shard with a row that can run (rows that are
null, empty, request errors or too long for --max-model-len are error rows: no device time, no input tokens; a job
with no other row loads no engine and is forecast at 0 device-seconds, as it runs: pipeline.shard; an image row's
images are read and counted in tokens by the model's processor from their sizes: jobs.plan.prompt_sizes), loads the
job's engine here (same model, device, dtype, quantization, image pixel limits, threads per worker) and measures it
in a short calibration on a sample of those rows:

1. the sample with the job's own sampling (per-row values included): the observed mean output tokens per row, the
   expected output length (bounded by max_tokens; rows that stop early pull it down);
2. the sample again with max_tokens 1, the prefix cache reset: prefill tokens per second;
3. decode step time at two batch sizes, the sample's and the job's concurrency (min(shard rows, max_num_seqs)),
   from copies of the sample prompts (their prefill comes from the prefix cache) run for 1 and 1 + K tokens with
   ignore_eos; a step's time is taken as affine in the batch size between the two.

A fresh engine's first call is timed as well (kernels loaded, weights packed: seconds on the CPU); each worker's
first shard pays it. A worker's one engine serves all its shards in one batch, so the job is costed per worker
(job_device_s): prefill (its input tokens / prefill rate) plus decode (its rows x expected output tokens / its
concurrency steps at that concurrency's step time; the concurrency: worker_concurrency, and no more rows than the
engine's KV pool holds at the rows' mean length, image tokens included) plus a small overhead per shard.
Device-seconds, cost at the job's price per hour and tokens per dollar follow. bench/README.md says how far off it
was on a real job. An embed, classify or score job is forecast by jobs.plan.forecast_pooling (its rows' tokens and the
encoder's measured tokens per second; input tokens and rows per dollar).
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow.parquet as pq
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from jobs.errors import JobError
from jobs.formats.openai_batch import batch_spec, is_openai_batch, read_batch_file
from jobs.plan.calibration_clock import load_stretch, start_clock, timed
from jobs.plan.prompt_sizes import prompt_sizes
from jobs.plugin import default_torch_threads, shard_slots
from jobs.spec import engine_config, run_config
from pipeline.accounting import PerDollar
from pipeline.config import InputError, RunConfig
from pipeline.images import image_rows
from pipeline.input import Shard
from pipeline.manifest import build_manifest
from pipeline.row_kinds import row_kind
from pipeline.row_options import row_sampling_params
from pipeline.shard import ShardRows, generate_rows, read_shard
from pipeline.shard_engine import EngineFacts
from schemas.job_spec import JobSpec

SAMPLE_ROWS = 16
CALIBRATION_STEPS = 8  # K: decode steps timed per batch size
# Seconds a shard adds to its worker's engine time (reading it, its checkpoint, results and accounting commits, less
# what other shards' steps overlap), measured: 128 GSM8K rows x 32 tokens, `python -m bench.forecast --rows-per-shard
# 1 / 1000` (AVX512-BF16 EPYC, 2026-11-27): the actual 20.2 - 11.2 s less the 8.2 s the smaller batch explains, over
# 127 more shards = 0.006 s; 0.02 keeps room for an object store's slower commits (bench/README.md). The 0.11 this
# replaced came from a loaded machine's two jobs of 32 rows and forecast 1 row per shard 1.6x the actual.
SHARED_SHARD_OVERHEAD_S = 0.02


@dataclass(frozen=True)
class Forecast(PerDollar):
    """A job's expected size and bill (tokens; seconds; USD).

    `input_tokens` is exact when the first shard holds every row, else its mean per row times the rows;
    `output_tokens` is the expected count (the calibration sample's mean per row), `output_tokens_max` the bound
    from max_tokens; `input_rows_sampled`: the rows tokenized for `input_tokens`. `device_s` is the expected
    device-seconds billed for the whole job (no preemptions), measured as device time (_timed: on the CPU the
    stepping thread's CPU time, so other processes' load at calibration time is left out); `uncertainty`: the
    relative spread of two measurements of the decode step (0.1 = 10%); `load_stretch`: the calibration's wall time
    over its device time (1 on a quiet machine; 2: other work took half the cores). A job run beside the same load
    is billed about `load_stretch` times `device_s` (billing is the device's wall time). `note`: what the figures
    cannot say (a job none of whose rows can run), else "". `quantization`: the weight
    quantization the run uses, as its summary and accounting will say it (pipeline.shard_engine.EngineFacts).
    `task`: the job's; an embed, classify or score job generates nothing (output figures 0, prefill_tokens_per_s: the
    encoder's input tokens per second, jobs.plan.forecast_pooling). `images`, `image_tokens`: the images of the rows
    that run and their tokens (part of `input_tokens`), extrapolated as it is; `rows_too_long`: rows read that are
    too long for --max-model-len (error rows); `kv_rows_at_once`: rows of the job's mean length (prompt with its
    image tokens, expected output) the engine's KV pool holds at once (0: not measured).
    """

    rows: int
    shards: int
    input_tokens: int
    output_tokens: int
    output_tokens_max: int
    sample_rows: int
    mean_output_tokens_observed: float
    prefill_tokens_per_s: float
    decode_step_s: dict[int, float]
    warmup_s: float
    device_s: float
    price_per_hour_usd: float
    device: str
    dtype: str
    model: str
    calibration_s: float
    note: str = ""
    input_rows_sampled: int = 0
    quantization: str = ""
    uncertainty: float = 0.0
    load_stretch: float = 1.0
    task: str = "generate"
    images: int = 0
    image_tokens: int = 0
    rows_too_long: int = 0
    kv_rows_at_once: int = 0

    @property
    def input_tokens_exact(self) -> bool:
        """Whether `input_tokens` counts every row (the tokenized sample held them all) rather than extrapolating."""
        return self.input_rows_sampled >= self.rows

    @property
    def device_hours(self) -> float:
        """Expected device-hours."""
        return self.device_s / 3600.0

    @property
    def cost_usd(self) -> float:
        """Expected cost at the job's price per device-hour, USD."""
        return self.device_hours * self.price_per_hour_usd

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready forecast (per-dollar figures: PerDollar's, expected; None when the price is 0)."""
        d = asdict(self)
        d["decode_step_s"] = {str(k): round(v, 6) for k, v in self.decode_step_s.items()}
        return {**d, "device_hours": self.device_hours, "cost_usd": self.cost_usd,
                "tokens_per_dollar": self.tokens_per_dollar, "input_tokens_per_dollar": self.input_tokens_per_dollar,
                "rows_per_dollar": self.rows_per_dollar}


def _timed(engine: LLMEngine, prompts: Sequence[Any], params: SamplingParams | list[SamplingParams],
           use_chat_template: bool) -> tuple[float, list]:
    """(device-seconds, outputs) of one `engine.generate` on this thread (jobs.plan.calibration_clock.timed)."""
    return timed(engine, lambda: engine.generate(list(prompts), params, use_chat_template=use_chat_template))


def _decode_step_s(engine: LLMEngine, prompts: list[Any], batch: int, use_chat_template: bool) -> tuple[float, float]:
    """(seconds per decode step with `batch` sequences (copies of `prompts`; their prefill is cached), the relative
    spread of two measurements of it)."""
    copies = [prompts[i % len(prompts)] for i in range(batch)]
    _timed(engine, copies, SamplingParams(max_tokens=1), use_chat_template)  # fills the prefix cache
    t1, _ = _timed(engine, copies, SamplingParams(max_tokens=1), use_chat_template)
    per_step = []
    for _ in range(2):
        tk, _ = _timed(engine, copies, SamplingParams(max_tokens=1 + CALIBRATION_STEPS, ignore_eos=True),
                       use_chat_template)
        per_step.append(max(tk - t1, 1e-9) / CALIBRATION_STEPS)
    mean = sum(per_step) / 2
    return mean, abs(per_step[0] - per_step[1]) / mean


def _sampling_of(rows: ShardRows, cfg: RunConfig, k: int) -> SamplingParams:
    """The row's sampling params as the job would run it (an out-of-range row value: the job's)."""
    try:
        return row_sampling_params(cfg.sampling_params(), rows.overrides[k] if rows.overrides else None)
    except ValueError:
        return cfg.sampling_params()


def forecast_job(spec: JobSpec, *, sample_rows: int = SAMPLE_ROWS) -> Forecast:
    """Forecast the job `spec` describes (see the module docstring; an embed, classify or score job: forecast_pooling's
    forecast_pooling_job). Writes nothing under OUTPUT. Loads the engine in this process (seconds to minutes).
    Raises JobError (exit 2) for bad input or options."""
    spec, cfg, shards, first, skipped = first_shard(spec, sample_rows)
    if first is None:
        return nothing_runs(spec, cfg, shards)
    return _calibrate(spec, cfg, shards, first, sample_rows, skipped)


def first_shard(spec: JobSpec, sample_rows: int) -> tuple[JobSpec, RunConfig, list[Shard], ShardRows | None, int]:
    """The job's shards planned as a first start would (an OpenAI batch file converted in a temporary folder) and
    the rows of the first one with a row that can run: (spec that runs, its RunConfig, shards, those rows or None
    when no row of the job can run, the rows of the shards before it). Raises JobError (exit 2) for bad input or
    options, no rows, or `sample_rows` < 1."""
    if sample_rows < 1:
        raise JobError(f"the calibration sample needs >= 1 row, got {sample_rows}")
    run_config(spec)
    with tempfile.TemporaryDirectory(prefix="tokenmill-forecast-") as tmp:
        if is_openai_batch(spec.input):
            table, _, source = read_batch_file(spec.input)
            pq.write_table(table, f"{tmp}/requests.parquet")
            spec = batch_spec(spec, f"{tmp}/requests.parquet", source)
        cfg = run_config(spec)
        try:
            manifest = build_manifest(spec.input, cfg)
        except InputError as e:
            raise JobError(str(e)) from e
        shards = manifest.shards()
        if not shards:
            raise JobError(f"{spec.input} holds no rows")
        column = manifest.prompt_column
        messages = column == cfg.messages_column != cfg.prompt_column
        skipped = 0  # rows of the leading shards none of whose rows can run (error rows: no device time)
        for shard in shards:
            first = read_shard(shard, column, cfg.id_column, messages=messages, pair_column=cfg.text_pair_column,
                               image_column=cfg.image_column)
            first = image_rows(first, shard.url, cfg.image_column, cfg.max_images_per_row)[0]  # as the run reads them
            if row_kind(cfg).requests(first, cfg).runnable:
                return spec, cfg, shards, first, skipped
            skipped += len(first.ids)
    return spec, cfg, shards, None, skipped


def nothing_runs(spec: JobSpec, cfg: RunConfig, shards: list[Shard]) -> Forecast:
    """The forecast of a job none of whose rows can run (every one null, empty, a request error or out-of-range
    sampling values): each becomes an error row, no shard loads an engine (pipeline.shard), nothing is billed."""
    rows = sum(s.num_rows for s in shards)
    facts = EngineFacts.planned(spec.model, engine_config(spec), None)
    return Forecast(
        rows=rows, shards=len(shards), input_tokens=0, output_tokens=0, output_tokens_max=0, sample_rows=0,
        mean_output_tokens_observed=0.0, prefill_tokens_per_s=0.0, decode_step_s={}, warmup_s=0.0, device_s=0.0,
        price_per_hour_usd=spec.price_per_hour, device=facts.device, dtype=facts.dtype, model=facts.model,
        quantization=facts.quantization, calibration_s=0.0, task=cfg.task,
        note=f"no row can run: all {rows:,} rows will be error rows (null, empty or request errors; the results' "
             "error column will say why); no engine loads, nothing is billed")


@dataclass(frozen=True)
class WorkerModel:
    """What job_device_s needs besides the shards: LocalCluster `workers` (one resident engine each), the engine's
    `max_num_seqs`, a fresh engine's first-call seconds `warmup_s`, the share of rows that run (`run_share`; error
    rows take no device time), mean input and output tokens per row, prefill tokens per second."""

    workers: int
    max_num_seqs: int
    warmup_s: float
    run_share: float
    mean_input_tokens: float
    mean_output_tokens: float
    prefill_tokens_per_s: float


def worker_concurrency(shard_rows: list[int], workers: int, max_num_seqs: int) -> int:
    """Rows one worker's engine decodes at once: its shards share one batch (jobs.plugin.shard_slots shards at a
    time), so min(max_num_seqs, slots x rows per shard, the worker's rows); at least 1."""
    rows_per_shard = max(shard_rows)
    per_worker = -(-sum(shard_rows) // max(1, min(workers, len(shard_rows))))
    slots = shard_slots(max_num_seqs, rows_per_shard)
    return max(1, min(max_num_seqs, slots * rows_per_shard, per_worker))


def job_device_s(shard_rows: list[int], m: WorkerModel, step_s: Callable[[int], float]) -> float:
    """Expected device-seconds of a job whose shards hold `shard_rows` rows, on `m.workers` resident engines.

    Shards go round-robin to the workers. A worker's engine serves all its shards in one batch (jobs.plugin,
    engine.loop.engine_loop): its device time is its warmup, plus the prefill of its rows, plus its decode steps
    (its rows x expected output tokens / its concurrency, worker_concurrency) at `step_s(concurrency)` seconds each,
    plus SHARED_SHARD_OVERHEAD_S per shard (reads and commits the other shards' steps do not hide). The job's
    device-seconds are the workers' sum (DeviceClock bills a worker's engine time to the shards on it). Before,
    each shard was costed as if it ran alone at its own concurrency: 1 row per shard forecast 5.2x what 1,000 did.
    """
    workers = max(1, min(m.workers, len(shard_rows)))
    concurrency = worker_concurrency(shard_rows, workers, m.max_num_seqs)
    total = 0.0
    for w in range(workers):
        mine = shard_rows[w::workers]
        rows = sum(mine) * m.run_share
        c = max(1, min(concurrency, round(rows)))
        total += (m.warmup_s + rows * m.mean_input_tokens / m.prefill_tokens_per_s
                  + math.ceil(rows * m.mean_output_tokens / c) * step_s(c) + len(mine) * SHARED_SHARD_OVERHEAD_S)
    return total


def calibration_engine(spec: JobSpec) -> tuple[EngineConfig, LLMEngine, float]:
    """(EngineConfig, engine, time.perf_counter() at the start) of a calibration: the job's engine loaded here with
    the threads a LocalCluster worker gives it (jobs.plugin), the calibration clock started."""
    econf = engine_config(spec)
    if spec.cluster.scheduler is None:
        torch.set_num_threads(default_torch_threads(spec.cluster.workers))
    t_start = time.perf_counter()
    start_clock()
    return econf, LLMEngine.from_model(spec.model, econf), t_start


def _calibrate(spec: JobSpec, cfg: RunConfig, shards: list[Shard], first: ShardRows, sample_rows: int,
               skipped: int = 0) -> Forecast:
    """Calibrate the engine on `first` (the first shard with a row that can run, after `skipped` rows of shards
    with none) and forecast the job's `shards` from it (module docstring)."""
    econf, engine, t_start = calibration_engine(spec)
    chat = cfg.use_chat_template
    sizes = prompt_sizes(engine, first, cfg)
    runnable, read = sizes.runnable, len(sizes.tokens) + skipped
    if not runnable:
        raise JobError("no row of the first shard can run (all empty, too long, or request errors); nothing to "
                       f"forecast{'. ' + sizes.too_long_note() if sizes.too_long else ''}")
    # A fresh engine's first step is slow (kernels loaded, weights packed): every worker's first shard pays it.
    warmup_s, _ = _timed(engine, [first.prompts[runnable[0]]], SamplingParams(max_tokens=1), chat)
    mean_in = sizes.ran(sizes.tokens) / read  # the rows that run: error rows bill no input tokens
    sample = runnable[:: max(1, len(runnable) // sample_rows)][:sample_rows]
    rows = first.take(sample)
    outs = generate_rows(engine, rows, cfg)
    mean_out = sum(o.num_output_tokens for o in outs) / len(outs)
    prompts = rows.prompts
    engine.reset_prefix_cache()
    t_prefill, outs1 = _timed(engine, prompts, SamplingParams(max_tokens=1), chat)
    prefill_rate = sum(o.num_prompt_tokens for o in outs1) / max(t_prefill, 1e-9)
    # No more rows at once than the KV pool holds at the running rows' mean length (prompt with images, output)
    kv_rows = engine.num_kv_blocks * engine.block_size // max(1, math.ceil(sizes.ran(sizes.tokens) / len(runnable)
                                                                           + mean_out))
    max_seqs = max(1, min(econf.max_num_seqs, kv_rows))
    concurrency = worker_concurrency([s.num_rows for s in shards], spec.cluster.workers, max_seqs)
    measured = {b: _decode_step_s(engine, prompts, b, chat) for b in sorted({len(prompts), concurrency})}
    steps = {b: m[0] for b, m in measured.items()}

    def step_s(batch: int) -> float:
        (b0, d0), (b1, d1) = min(steps.items()), max(steps.items())
        return d0 if b1 == b0 else d0 + (d1 - d0) * (batch - b0) / (b1 - b0)

    max_out = [_sampling_of(first, cfg, k).max_tokens for k in runnable]
    ok = len(runnable) / read  # the share of rows that run (error rows: no device time)
    device_s = job_device_s([s.num_rows for s in shards], WorkerModel(
        workers=spec.cluster.workers, max_num_seqs=max_seqs, warmup_s=warmup_s, run_share=ok,
        mean_input_tokens=mean_in, mean_output_tokens=mean_out, prefill_tokens_per_s=prefill_rate), step_s)
    total_rows = sum(s.num_rows for s in shards)
    return Forecast(
        rows=total_rows, shards=len(shards), input_tokens=round(mean_in * total_rows),
        output_tokens=round(mean_out * total_rows * ok),
        output_tokens_max=round(sum(max_out) / len(max_out) * total_rows * ok),
        sample_rows=len(sample), mean_output_tokens_observed=mean_out, prefill_tokens_per_s=prefill_rate,
        decode_step_s=steps, warmup_s=warmup_s, device_s=device_s, price_per_hour_usd=spec.price_per_hour,
        device=engine.device_name,
        dtype=str(engine.dtype).removeprefix("torch."), model=engine.model_name,
        quantization=EngineFacts.of(engine, None).quantization,
        calibration_s=time.perf_counter() - t_start, input_rows_sampled=read,
        uncertainty=max(m[1] for m in measured.values()), load_stretch=load_stretch(),
        images=round(sizes.ran(sizes.images) / read * total_rows),
        image_tokens=round(sizes.ran(sizes.image_tokens) / read * total_rows), rows_too_long=len(sizes.too_long),
        kv_rows_at_once=kv_rows, note=sizes.too_long_note())
