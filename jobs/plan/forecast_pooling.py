"""The forecast of an embed, classify or score job (`tokenmill run --task embed|classify|score --dry-run`): rows,
input tokens, device-hours, USD, input tokens and rows per dollar.

As the generate forecast (jobs.plan.forecast) does, it measures rather than assumes: the job's engine is loaded here
(same model, device, dtype, threads per worker) and

1. every row of the first shard with a row that can run is tokenized as the job will embed it (the model's
   tokenizer, the --prefix, cut at max_seq_length: engine.pooling.embedder.Embedder.token_counts; a score job's
   (text, text pair) as engine.pooling.scorer.Scorer.token_counts counts them: a cross-encoder's pair as one
   sequence, an embedding model's two texts each; null and empty rows (either text of a pair) are error rows:
   0 tokens, no device time), its mean per row times the job's rows is the input tokens;
2. a fresh engine's first call (one row) is timed: each worker's first shard pays it;
3. a sample of up to SAMPLE_ROWS of those rows is embedded (classified, scored) twice, as one call like a shard's
   chunk (the engine sorts and batches it by its token budget); the second call's device time gives the encoder's input
   tokens per second (jobs.plan.calibration_clock.timed: CPU time of the calling thread on the CPU), the two
   calls' spread the forecast's `uncertainty`.

An encoder keeps no KV cache and decodes nothing, so a worker's device time is its warmup, its rows' tokens at that
rate, and the per-shard overhead (jobs.plan.forecast.job_device_s with no output tokens). The rate is measured on
the sample's lengths: a job whose rows are much longer than the first shard's runs slower per token (attention
grows with the row).
"""

from __future__ import annotations

import time

from engine import LLMEngine
from engine.pooling.embed_options import EmbedOptions
from jobs.errors import JobError
from jobs.plan.calibration_clock import load_stretch, timed
from jobs.plan.forecast import Forecast, WorkerModel, calibration_engine, first_shard, job_device_s, nothing_runs
from pipeline.config import RunConfig
from pipeline.input import Shard
from pipeline.shard import ShardRows
from pipeline.shard_engine import EngineFacts
from schemas.job_spec import JobSpec

SAMPLE_ROWS = 64  # rows embedded to time the encoder: batches like a shard's chunk, seconds on a CPU


def _run(engine: LLMEngine, cfg: RunConfig, rows: ShardRows, picked: list[int]) -> object:
    """The job's call on the rows `picked` of `rows`: embed with its options, classify, or score with their pairs."""
    texts = [rows.prompts[k] for k in picked]
    if cfg.task == "classify":
        return engine.classify(texts)
    if cfg.task == "score":
        return engine.score(texts, [rows.pairs[k] for k in picked])  # type: ignore[index]
    return engine.embed(texts, **cfg.embed_options())  # type: ignore[arg-type]


def _token_counts(engine: LLMEngine, cfg: RunConfig, rows: ShardRows) -> list[int]:
    """Tokens each of `rows` will be run with, as the job counts them (module docstring, 1.); 0 for an error row."""
    prompts = [None if (rows.errors and rows.errors[k]) else p for k, p in enumerate(rows.prompts)]
    if cfg.task == "score":
        return engine.scorer.token_counts(prompts, rows.pairs or [None] * len(prompts))  # type: ignore[union-attr]
    prefix = {"prefix": cfg.prefix} if cfg.task == "embed" else {}
    return engine.pooling_runner.token_counts(prompts, EmbedOptions(**prefix))  # type: ignore[union-attr]


def forecast_pooling_job(spec: JobSpec, *, sample_rows: int = SAMPLE_ROWS) -> Forecast:
    """Forecast the embed, classify or score job `spec` describes (module docstring; its shards planned as
    jobs.plan.forecast.first_shard plans them). Writes nothing under OUTPUT. Loads the engine in this process.
    Raises JobError (exit 2) for bad input or options."""
    spec, cfg, shards, first, skipped = first_shard(spec, sample_rows)
    if first is None:
        return nothing_runs(spec, cfg, shards)
    return calibrate_pooling(spec, cfg, shards, first, sample_rows, skipped)


def calibrate_pooling(spec: JobSpec, cfg: RunConfig, shards: list[Shard], first: ShardRows, sample_rows: int,
                      skipped: int = 0) -> Forecast:
    """Forecast an embed, classify or score job's `shards` from `first` (the first shard with a row that can run, after
    `skipped` rows of shards with none; module docstring). `sample_rows`: the generate forecast's sample size; the
    encoder's is at least SAMPLE_ROWS. Raises JobError (exit 2) when no row of `first` can run."""
    econf, engine, t_start = calibration_engine(spec)
    if engine.pooling_runner is None or (cfg.task == "score" and engine.scorer is None):
        raise JobError(f"--model {spec.model} does not {cfg.task}; nothing to forecast")
    lengths = _token_counts(engine, cfg, first)
    runnable = [k for k, n in enumerate(lengths) if n > 0]
    if not runnable:
        raise JobError("no row of the first shard can run (all null, empty or request errors); nothing to forecast")
    warmup_s, _ = timed(engine, lambda: _run(engine, cfg, first, runnable[:1]))
    n = max(sample_rows, SAMPLE_ROWS)
    sample = runnable[:: max(1, len(runnable) // n)][:n]
    t1, t2 = (timed(engine, lambda: _run(engine, cfg, first, sample))[0] for _ in range(2))
    rate = sum(lengths[k] for k in sample) / max(t2, 1e-9)  # the second: the sample's batch shapes seen once
    rows = len(lengths) + skipped
    mean_in, ok = sum(lengths) / rows, len(runnable) / rows
    total_rows = sum(s.num_rows for s in shards)
    device_s = job_device_s([s.num_rows for s in shards], WorkerModel(
        workers=spec.cluster.workers, max_num_seqs=econf.max_num_seqs, warmup_s=warmup_s, run_share=ok,
        mean_input_tokens=mean_in, mean_output_tokens=0.0, prefill_tokens_per_s=rate), lambda batch: 0.0)
    return Forecast(
        rows=total_rows, shards=len(shards), input_tokens=round(mean_in * total_rows), output_tokens=0,
        output_tokens_max=0, sample_rows=len(sample), mean_output_tokens_observed=0.0, prefill_tokens_per_s=rate,
        decode_step_s={}, warmup_s=warmup_s, device_s=device_s, price_per_hour_usd=spec.price_per_hour,
        device=engine.device_name, dtype=str(engine.dtype).removeprefix("torch."), model=engine.model_name,
        quantization=EngineFacts.of(engine, None).quantization, calibration_s=time.perf_counter() - t_start,
        input_rows_sampled=rows, uncertainty=abs(t1 - t2) / max((t1 + t2) / 2, 1e-9), load_stretch=load_stretch(),
        task=cfg.task)
