"""From a job spec (schemas.job_spec.JobSpec: a YAML file, or `tokenmill run`'s options) to a run of the job: the
pipeline's RunConfig and the engine's EngineConfig are built here from the spec's fields, by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import fsspec

from engine import EngineConfig
from jobs.errors import JobError
from jobs.formats.openai_batch import prepare_spec
from jobs.formats.openai_batch_task import batch_task
from jobs.metrics import JobMetrics
from jobs.plan.image_check import check_images
from jobs.plan.preflight import (
    check_device,
    check_max_model_len,
    check_model,
    check_output,
    check_quantization,
    check_store,
    model_context,
)
from jobs.plan.task_check import check_embedding, check_task, task_model
from jobs.summary import JobSummary
from pipeline.config import InputError, RunConfig
from schemas.job_spec import JobSpec

if TYPE_CHECKING:
    from engine.worker.memory_fit import MemoryFit
    from pipeline.shard import ProgressFn


def json_schema_text(value: str | None) -> str | None:
    """The spec's json_schema as JSON text: itself when it is JSON text (it starts with `{`), else the content of
    the file or fsspec URL it names. Raises JobError (exit 2) when the file cannot be read."""
    if value is None or value.lstrip().startswith("{"):
        return value
    try:
        with fsspec.open(value, "rt", encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise JobError(f"cannot read the JSON Schema file {value!r} of --json-schema: {e}; give a readable file "
                       "or the schema as JSON text") from e


def run_config(spec: JobSpec) -> RunConfig:
    """The pipeline's RunConfig of a spec (its columns, sampling and sharding sections, the price and the task; a
    json_schema file read, json_schema_text; an embed job's embedding width from its model's files, or its
    --dimensions; its embed options). Raises JobError (exit 2) for a value out of range, an embedding model whose
    files cannot be read, or embed options (jobs.plan.task_check.check_embedding) on a generate job or over the
    model's width."""
    c = spec.columns
    sampling = spec.sampling.model_dump()
    sampling["json_schema"] = json_schema_text(sampling["json_schema"])
    dim = check_embedding(spec.model, spec.task, spec.embedding)
    try:
        return RunConfig(prompt_column=c.prompt, messages_column=c.messages, id_column=c.id,
                         text_pair_column=c.text_pair, image_column=c.image,
                         max_images_per_row=c.max_images_per_row, max_pixels=c.max_pixels,
                         min_pixels=c.min_pixels,
                         use_chat_template=c.chat_template, allow_special_tokens=c.allow_special_tokens,
                         **sampling, **spec.sharding.model_dump(), price_per_hour_usd=spec.price_per_hour,
                         task=spec.task, embedding_dim=dim, **spec.embedding.model_dump())
    except (InputError, ValueError) as e:
        raise JobError(str(e)) from e


def engine_config(spec: JobSpec) -> EngineConfig:
    """The engine's EngineConfig of a spec's engine section (kv_cache_gib GiB -> bytes) and its image pixel limits
    (columns max_pixels / min_pixels). Raises JobError (exit 2) for a value the engine refuses."""
    e = spec.engine
    try:
        return EngineConfig(device=e.device, dtype=e.dtype, quantization=e.quantization,
                            max_num_seqs=e.max_num_seqs, kv_cache_memory_bytes=None if e.kv_cache_gib is None
                            else int(e.kv_cache_gib * (1 << 30)),
                            max_model_len=e.max_model_len, max_image_pixels=spec.columns.max_pixels,
                            min_image_pixels=spec.columns.min_pixels)
    except ValueError as err:
        raise JobError(str(err)) from err


def checked_spec(spec: JobSpec) -> JobSpec:
    """The spec with OUTPUT and a local model made absolute (for --task embed without --model: the default
    embedding model; an OpenAI batch file of /v1/embeddings runs as --task embed: batch_task), after
    jobs.plan.preflight's checks of both, of the task against the model (jobs.plan.task_check, and its embed
    options), of the image options against the model (jobs.plan.image_check), of --max-model-len and
    --quantization against the model and of a CUDA --device here. Raises JobError (exit 2) naming the problem and
    the fix, or the object store of INPUT or the model not answering."""
    check_store(spec.input, "INPUT")
    spec = batch_task(spec)
    check_store(spec.model, "--model")
    model = check_model(task_model(spec.model, spec.task))
    check_task(model, spec.task)
    check_images(model, spec)
    check_embedding(model, spec.task, spec.embedding)
    e = spec.engine
    check_device(e.device, spec.cluster.scheduler)
    check_quantization(model, e.quantization)
    check_max_model_len(model, e.device, e.dtype, e.max_model_len, e.kv_cache_gib)
    spec_fit(spec, model)
    return spec.model_copy(update={"output": check_output(spec.output), "model": model})


def spec_fit(spec: JobSpec, model: str | None) -> MemoryFit | None:
    """The job's model against the memory of the device its workers use on this machine (jobs.plan.model_fit): None
    for a cluster's workers (--scheduler: their device is elsewhere) and a model at a URL (its worker checks it).
    `model` as check_model returns it. Raises JobError (exit 2) when one sequence of --max-model-len does not fit,
    naming the numbers and the ways out."""
    if spec.cluster.scheduler is not None:
        return None
    from jobs.plan.model_fit import check_fit

    return check_fit(model, engine_config(spec), model_context(model))


def run_spec(spec: JobSpec, *, resume: bool = False, on_start: Callable[[int], None] | None = None,
             on_progress: ProgressFn | None = None, metrics_file: str | None = None) -> JobSummary:
    """Run (or resume, or find finished) the job a spec describes; see jobs.runner.run_job for what happens and
    the JobError exit codes it raises. An OpenAI batch file (.jsonl) as input is converted first
    (jobs.formats.openai_batch.prepare_spec). Metrics go to TOKENMILL_PUSHGATEWAY_URL and/or `metrics_file` (a
    node_exporter textfile) as the run goes (jobs.metrics)."""
    from jobs.runner import run_job  # Dask and the engine (torch): not for a spec refused before any work

    engine = engine_config(spec)
    spec = batch_task(spec)
    run_config(spec)  # bad options stop here, before a batch file is staged under OUTPUT
    spec = checked_spec(spec)
    try:
        metrics = JobMetrics.from_env(spec.output, spec.model, metrics_file)
    except ValueError as e:
        raise JobError(str(e)) from e
    spec = prepare_spec(spec, check=run_config)  # the staged file's options checked before it is staged
    cfg = run_config(spec)
    if metrics is not None:
        on_start, on_progress = _tee(on_start, metrics.start), _tee(on_progress, metrics.progress)
    summary = run_job(spec.input, spec.output, cfg, model=spec.model, engine_config=engine,
                      workers=spec.cluster.workers, scheduler_address=spec.cluster.scheduler,
                      gpus_per_worker=spec.cluster.gpus_per_worker, resume=resume,
                      on_start=on_start, on_progress=on_progress)
    if metrics is not None:
        metrics.finish(summary)
    return summary


def _tee(first: Callable[..., None] | None, second: Callable[..., None]) -> Callable[..., None]:
    """A callback that calls `first` (when given), then `second`, with the same arguments."""
    def both(*args: int) -> None:
        if first is not None:
            first(*args)
        second(*args)
    return both
